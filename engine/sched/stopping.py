"""The stop rules: which tokens end a choice (computed once per request and sent in the plan,
so the sampler's min_tokens ban reads the same set), and whether a choice stops after a token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.sched.request import Request, RequestStatus
from ipc.sampling import SamplingParams


@dataclass(frozen=True)
class Stop:
    status: RequestStatus  # a finished status
    stop_reason: int | None = None  # the stop_token_ids entry that ended it (not EOS)


class Stopping:
    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def end_tokens(self, s: SamplingParams) -> frozenset[int]:
        """The tokens that end a choice: its stop_token_ids, and EOS unless ignore_eos."""
        return frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos
                                              else self.eos_token_ids)

    def check(self, req: Request, token: int) -> Stop | None:
        """Whether the choice stops now that it appended `token` (None: it goes on)."""
        s = req.sampling
        if req.error is not None:
            return Stop(RequestStatus.FINISHED_ERROR)
        if req.num_output_tokens > s.min_tokens and token in req.end_token_ids:
            as_eos = not s.ignore_eos and token in self.eos_token_ids
            return Stop(RequestStatus.FINISHED_STOPPED, None if as_eos else token)
        if req.grammar is not None and req.grammar.stopped:
            return Stop(RequestStatus.FINISHED_STOPPED)  # complete: nothing may follow
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return Stop(RequestStatus.FINISHED_LENGTH)
        return None
