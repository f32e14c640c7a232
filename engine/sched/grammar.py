"""The grammar policy: the allowed-token masks of the choices that sample (engine/sched/
grammar_masks.py fills them), and budget closing. A choice whose grammar can close keeps room
for the tokens its closing needs (Matcher.closing_path), an end token included where the
grammar would take more after it. When its budget comes down to them, its mask allows only the
closing's next token; a sampled token after which no closing fits in what is left is refused,
and the step is taken again with the closing forced. A position is refused at most once, so
every choice moves on: budget closing never holds a reply from its end."""

from __future__ import annotations

from collections.abc import Container

from engine.sched.grammar_masks import GrammarMasks
from engine.sched.request import Request
from engine.step_plan import GrammarMask


class Grammars:
    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self._masks = GrammarMasks(vocab_size)

    def masks(self, reqs: list[Request], drafts: dict[str, list[int]]) -> dict[str, GrammarMask]:
        """The grammar's allowed tokens at each sampling position of these choices (those
        verifying `drafts`, by key, get one row per draft position)."""
        plain = [r for r in reqs if r.grammar is not None and not drafts.get(r.key)]
        found: dict[str, GrammarMask] = {}
        if plain:
            masks = self._masks.plain([r.grammar for r in plain])  # type: ignore[misc]
            found.update((r.key, m) for r, m in zip(plain, masks, strict=True))
        for req in plain:
            if closes_on_budget(req):
                token = forced_token(req, self.max_model_len)
                if token is not None:
                    found[req.key] = self._masks.only(token)
        for req in reqs:
            if req.grammar is not None and drafts.get(req.key):
                found[req.key] = self._masks.with_drafts(req.grammar, drafts[req.key])
        return found

    def refuses(self, req: Request, token: int) -> bool:
        """Budget closing: `token` must be dropped (no closing fits after it); the scheduler
        then computes its position again, and the next mask forces the closing."""
        if not closes_on_budget(req) or req.closing.refused_at == req.num_output_tokens:
            return False  # NOTE: refused here once already: the token stands (progress)
        if not refuses(req, token, req.end_token_ids, self.max_model_len):
            return False
        req.closing.forced = True
        req.closing.refused_at = req.num_output_tokens
        return True


def closes_on_budget(req: Request) -> bool:
    """The choice's grammar closes on its budget (beams pick among candidates: not those)."""
    return (req.grammar is not None and req.grammar.closes_on_budget
            and not req.sampling.use_beam_search)


def tokens_left(req: Request, max_model_len: int) -> int:
    """Tokens the choice may still emit, this step's included."""
    return min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens)


def end_choices(req: Request, outputs: int) -> list[int]:
    """The tokens a closing may end with from the state after `outputs` output tokens: the
    choice's end tokens, once min_tokens lets the next of them end it (else none)."""
    if outputs + 1 <= req.sampling.min_tokens:
        return []
    return sorted(req.end_token_ids)


def forced_token(req: Request, max_model_len: int) -> int | None:
    """The one token the choice may sample now, or None (the grammar's own mask applies).

    Records how long the closing is from here (`req.closing.length`: None when none fits in
    the budget, so nothing is reserved and the reply may end open, as without closing; None
    too when the closing is empty, the grammar complete with no end token allowed: there is
    nothing to force, and refusing tokens would hold the choice in place)."""
    assert req.grammar is not None
    left = tokens_left(req, max_model_len)
    done, path = req.closing.after
    if done != req.num_output_tokens:  # NOTE: else `refuses` found it from this very state
        path = req.grammar.closing_path(left, ends=end_choices(req, req.num_output_tokens))
    req.closing.length = len(path) if path else None
    if not path:
        return None
    if req.closing.forced or len(path) >= left:
        req.closing.forced = True
        return path[0]
    return None


def refuses(req: Request, token: int, ends: Container[int], max_model_len: int) -> bool:
    """True when a closing fitted before `token` and none fits after it (the token is then
    not appended: the caller recomputes the position and the next mask forces the closing).
    `ends`: tokens that end the choice (EOS, stop token ids), never refused."""
    if req.closing.length is None or token in ends:
        return False
    left = tokens_left(req, max_model_len) - 1
    assert req.grammar is not None
    path = req.grammar.closing_path(left, after=token,
                                    ends=end_choices(req, req.num_output_tokens + 1))
    req.closing.after = (req.num_output_tokens + 1, path)
    return path is None
