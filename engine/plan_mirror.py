"""The scheduler's record of what the runner holds of each choice, so that a step plan sends a
choice in full once (NewRequest) and as diffs after (CachedRequest)."""

from __future__ import annotations

from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.step_plan import CachedRequest, Diff, NewRequest, StepPlan


class RunnerMirror:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._num_tokens: dict[str, int] = {}  # key -> tokens the runner holds
        self._clean: dict[str, int] = {}  # key -> leading tokens of those still right
        self._finished: list[str] = []  # keys the runner holds that finished since the plan

    def add_to(self, plan: StepPlan, req: Request) -> None:
        """The entry that brings the runner's copy of `req` up to date for this plan."""
        key = req.key
        table = self.kv.take_table_diff(key)
        if key not in self._num_tokens:
            plan.new_requests.append(NewRequest(
                key, list(req.all_token_ids), req.num_prompt_tokens, req.sampling, req.seed,
                [] if table is None else table.values, req.num_computed_tokens, req.lora_id))
        else:
            plan.cached_requests.append(CachedRequest(
                key, self._token_diff(req), table, req.num_computed_tokens))
        self._num_tokens[key] = self._clean[key] = req.num_tokens

    def rewrite_tokens(self, req: Request, start: int) -> None:
        """The choice's tokens from `start` on were replaced (a beam took another's)."""
        if req.key in self._clean:
            self._clean[req.key] = min(self._clean[req.key], start)

    def finished(self, key: str) -> None:
        self.kv.forget(key)
        if self._num_tokens.pop(key, None) is not None:
            del self._clean[key]
            self._finished.append(key)

    def take_finished(self) -> list[str]:
        keys, self._finished = self._finished, []
        return keys

    def _token_diff(self, req: Request) -> Diff | None:
        start = self._clean[req.key]
        if start == self._num_tokens[req.key] == req.num_tokens:
            return None
        return Diff(start, req.all_token_ids[start:])
