"""The scheduler's record of what the runner holds of each choice (its tokens and its block
table), so that a step plan sends a choice in full once (NewRequest) and as diffs after
(CachedRequest). The one place such diffs are made: the KV manager keeps no runner state."""

from __future__ import annotations

from collections.abc import Sequence

from engine.sched.kv_manager import KVCacheManager
from engine.sched.request import Request
from engine.step_plan import CachedRequest, Diff, NewRequest, StepPlan


class RunnerMirror:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._num_tokens: dict[str, int] = {}  # key -> tokens the runner holds
        self._clean: dict[str, int] = {}  # key -> leading tokens of those still right
        self._tables: dict[str, list[int]] = {}  # key -> the block table the runner holds
        self._finished: list[str] = []  # keys the runner holds that finished since the plan

    def add_to(self, plan: StepPlan, req: Request) -> None:
        """The entry that brings the runner's copy of `req` up to date for this plan."""
        key = req.key
        if key not in self._num_tokens:
            table = list(self.kv.table(key))
            plan.new_requests.append(NewRequest(
                key, list(req.all_token_ids), req.num_prompt_tokens, req.sampling, req.seed,
                table, req.num_computed_tokens, sorted(req.end_token_ids), req.lora_id))
            self._tables[key] = table
        else:
            plan.cached_requests.append(CachedRequest(
                key, self._token_diff(req), self._table_diff(key), req.num_computed_tokens))
        self._num_tokens[key] = self._clean[key] = req.num_tokens

    def rewrite_tokens(self, req: Request, start: int) -> None:
        """The choice's tokens from `start` on were replaced (a beam took another's)."""
        if req.key in self._clean:
            self._clean[req.key] = min(self._clean[req.key], start)

    def finished(self, key: str) -> None:
        if self._num_tokens.pop(key, None) is not None:
            del self._clean[key], self._tables[key]
            self._finished.append(key)

    def take_finished(self) -> list[str]:
        keys, self._finished = self._finished, []
        return keys

    def _token_diff(self, req: Request) -> Diff | None:
        start = self._clean[req.key]
        if start == self._num_tokens[req.key] == req.num_tokens:
            return None
        return Diff(start, req.all_token_ids[start:])

    def _table_diff(self, key: str) -> Diff | None:
        """The edit from the table the runner holds to the KV manager's (None: the same)."""
        table, sent = self.kv.table(key), self._tables[key]
        if sent == table:  # NOTE: the common step (no new block): one C-level list compare
            return None
        start = _common_prefix(sent, table)
        self._tables[key] = list(table)
        return Diff(start, list(table[start:]))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
