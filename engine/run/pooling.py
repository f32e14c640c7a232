"""Pooling of prefill-only (embedding) rows: each step's prompt chunk of hidden states is folded
into the row's running pool (mean sums across chunks, CLS keeps position 0, last the final
position), and the row's vector is returned when its chunk reaches the end of the prompt. A
cross-encoder's score head, when the model has one, turns the pooled state into its score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.step_plan import StepPlan
from ipc.sampling import SamplingParams


class PoolRow(Protocol):
    key: str
    sampling: SamplingParams
    num_computed_tokens: int  # where this step's chunk starts
    num_prompt_tokens: int


@dataclass
class _Partial:
    total: torch.Tensor  # mean: the sum so far; cls: position 0's state; [hidden] float32
    count: int  # positions folded in


class Pooler:
    """Running pools by row key, kept across a long prompt's chunks until the last one."""

    def __init__(self, head: nn.Module | None = None) -> None:
        """head: a cross-encoder's score head (hidden -> num_labels, the model's `score`),
        applied to the last token's state; a row's vector is then its sigmoid."""
        self._head = head
        self._partial: dict[str, _Partial] = {}

    def drop(self, keys: list[str]) -> None:
        """Rows that finished (or were aborted mid-prompt) lose their partial pools."""
        for key in keys:
            self._partial.pop(key, None)

    def step(self, plan: StepPlan, rows: dict[str, PoolRow], hidden: torch.Tensor,
             last: dict[str, int]) -> dict[str, list[float]]:
        """hidden: [num_tokens, hidden_size], the step's final-norm states; last: each key's
        last row in it. Returns the vectors of the rows whose prompt ends in this step."""
        done: dict[str, list[float]] = {}
        for key, n in plan.num_scheduled_tokens.items():
            row = rows[key]
            params = row.sampling.pooling
            if params is None:
                continue
            chunk = hidden[last[key] - n + 1 : last[key] + 1]  # [n, hidden_size]
            start = row.num_computed_tokens
            if start == 0:  # NOTE: also a restart after a preemption by recompute
                self._partial.pop(key, None)
            self._fold(key, params.method, chunk, start)
            if start + n == row.num_prompt_tokens:
                done[key] = self._finish(self._partial.pop(key, None), params.method, chunk,
                                         params.dimensions, bool(params.normalize))
        return done

    def _fold(self, key: str, method: str | None, chunk: torch.Tensor, start: int) -> None:
        if method == "mean":
            part = self._partial.get(key)
            total = chunk.float().sum(0)
            if part is None:
                self._partial[key] = _Partial(total, len(chunk))
            else:
                part.total += total
                part.count += len(chunk)
        elif method == "cls" and start == 0:
            self._partial[key] = _Partial(chunk[0].float().clone(), 1)


    def _finish(self, part: _Partial | None, method: str | None, chunk: torch.Tensor,
                dimensions: int | None, normalize: bool) -> list[float]:
        if self._head is not None:
            # NOTE: a cross-encoder (HF's *ForSequenceClassification): the head on the last
            # token's state, then a sigmoid (one label: sentence-transformers' CrossEncoder
            # and vLLM score so). The engine sends it last-token rows only.
            assert method == "last", f"a score head pools the last token, not {method}"
            return torch.sigmoid(self._head(chunk[-1:])[0].float()).tolist()
        if method == "last":
            vec = chunk[-1].float()
        else:
            assert part is not None, f"{method} pooling lost its partial pool"
            vec = part.total / part.count if method == "mean" else part.total
        if dimensions is not None:  # NOTE: Matryoshka: truncate first, then normalize (vLLM)
            vec = vec[:dimensions]
        if normalize:
            vec = F.normalize(vec, dim=0)
        return vec.tolist()
