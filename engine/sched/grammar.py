"""Budget closing, the scheduler's side: a choice whose grammar can close keeps room for the
tokens its closing needs (Matcher.closing_path). When its budget comes down to them, its mask
allows only the closing's next token; a sampled token after which no closing fits in what is
left is refused, and the step is taken again with the closing forced."""

from __future__ import annotations

from collections.abc import Container

from engine.sched.request import Request


def closes_on_budget(req: Request) -> bool:
    """The choice's grammar closes on its budget (beams pick among candidates: not those)."""
    return (req.grammar is not None and req.grammar.closes_on_budget
            and not req.sampling.use_beam_search)


def tokens_left(req: Request, max_model_len: int) -> int:
    """Tokens the choice may still emit, this step's included."""
    return min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens)


def forced_token(req: Request, max_model_len: int) -> int | None:
    """The one token the choice may sample now, or None (the grammar's own mask applies).

    Records how long the closing is from here (`req.closing_length`: None when none fits in
    the budget, so nothing is reserved and the reply may end open, as without closing)."""
    assert req.grammar is not None
    left = tokens_left(req, max_model_len)
    done, path = req.closing_after
    if done != req.num_output_tokens:  # NOTE: else `refuses` found it from this very state
        path = req.grammar.closing_path(left)
    req.closing_length = None if path is None else len(path)
    if not path:
        return None
    if req.closing_forced or len(path) >= left:
        req.closing_forced = True
        return path[0]
    return None


def refuses(req: Request, token: int, ends: Container[int], max_model_len: int) -> bool:
    """True when a closing fitted before `token` and none fits after it (the token is then
    not appended: the caller recomputes the position and the next mask forces the closing).
    `ends`: tokens that end the choice (EOS, stop token ids), never refused."""
    if req.closing_length is None or token in ends:
        return False
    left = tokens_left(req, max_model_len) - 1
    assert req.grammar is not None
    path = req.grammar.closing_path(left, after=token)
    req.closing_after = (req.num_output_tokens + 1, path)
    return path is None
