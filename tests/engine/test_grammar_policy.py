"""The grammar policy's progress rule (engine/sched/grammar.py): a sampled token after which no
closing fits is refused, but one output position is refused at most once, so a choice whose
closing cannot be forced (the search finds none from the forced token's state) still moves on.
The grammar here is a stand-in whose closing search never succeeds after a token: the real one
reaches that only from contrived states."""

from __future__ import annotations

from engine.sched.grammar import Grammars
from engine.sched.request import Request
from ipc.sampling import SamplingParams


class _NeverCloses:
    """A grammar that can close now (one token) but never after any further token."""

    closes_on_budget = True

    def closing_path(self, limit: int, after: int | None = None, ends=()) -> list[int] | None:
        return [5] if after is None and limit >= 1 else None

    def accept(self, token: int) -> bool:
        return True


def _request() -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), max_tokens=4)
    req.grammar = _NeverCloses()  # type: ignore[assignment]
    req.closing.length = 1  # the last planned state had a closing of one token
    return req


def test_a_position_is_refused_once_then_its_token_stands() -> None:
    grammars, req = Grammars(vocab_size=8, max_model_len=64), _request()
    assert grammars.refuses(req, 7) and req.closing.forced
    assert not grammars.refuses(req, 7)  # the same position again: the token stands
    req.append_token(7)
    req.closing.length = 1
    assert grammars.refuses(req, 6)  # a new position may be refused once more


def test_end_tokens_are_never_refused() -> None:
    grammars, req = Grammars(vocab_size=8, max_model_len=64), _request()
    req.end_token_ids = frozenset({2})
    assert not grammars.refuses(req, 2)
