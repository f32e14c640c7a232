"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One pass over a [num_requests, vocab] logits tensor; only seeded rows draw their noise one by
one (from the request's own generator), so a seed gives the same tokens in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.run.verify import verify as verify_drafts
from ipc.messages import PositionLogprobs, TokenLogprob
from ipc.sampling import SamplingParams
from kernels.cpu import ops as cpu_ops


class SamplingRow(Protocol):
    """What the sampler reads of a row (engine.run.rows.Row is the one implementation)."""

    sampling: SamplingParams
    generator: torch.Generator | None  # its own seeded generator, or None: the shared one
    spec_token_ids: list[int]  # drafts to verify (verify only)
    spec_draft_probs: torch.Tensor | None  # [gamma, vocab], None: one-hot drafts
    grammar_mask: np.ndarray | None  # int32 [rows, ceil(vocab / 32)] allowed-token bits
    end_token_ids: list[int]  # the tokens that end it (the plan's): banned before min_tokens

    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...


Rows = Sequence[SamplingRow]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sampled row
    logprobs: list[PositionLogprobs | None]  # per row, when it asked for logprobs


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Rows) -> SamplerOutput:
        """logits: [len(requests), vocab] float32 -> one token per request."""
        raw = logits
        logits = self._apply_logit_bias(logits, requests)
        logits = self._apply_penalties(logits, requests)
        shaped = logits
        logits = self._apply_min_tokens(logits, requests)
        logits = self._apply_grammar(logits, requests, shaped)
        token_ids = self._sample(logits, requests)
        logprobs = self._logprobs(raw, token_ids, requests)
        return SamplerOutput(token_ids.tolist(), logprobs)

    # ---- logits processing -----------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, requests: Rows) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling.has_penalty]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:  # NOTE: rare path; per-row bincount keeps memory at O(vocab)
            s = requests[i].sampling
            out = torch.tensor(requests[i].output_token_ids, dtype=torch.long, device=self.device)
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            row = logits[i]
            if s.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(requests[i].prompt_token_ids, device=self.device)
                seen[prompt] = True
                penalized = torch.where(row > 0, row / s.repetition_penalty,
                                        row * s.repetition_penalty)
                row = torch.where(seen, penalized, row)
            row = row - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
            logits[i] = row
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, requests: Rows) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling.logit_bias]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            ids, biases = zip(*requests[i].sampling.logit_bias, strict=True)
            logits[i, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, requests: Rows) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.sampling.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            banned = requests[i].end_token_ids
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _apply_grammar(self, logits: torch.Tensor, requests: Rows,
                       before_min_tokens: torch.Tensor) -> torch.Tensor:
        """Tokens the request's grammar does not allow next go to -inf, before any sampling
        rule (greedy too). `before_min_tokens` is `logits` without min_tokens' bans: the
        grammar's fallback when those bans leave a row nothing."""
        rows = [i for i, r in enumerate(requests) if r.grammar_mask is not None]
        if not rows:
            return logits
        masks = np.concatenate([requests[i].grammar_mask[:1] for i in rows])  # type: ignore[index]
        allowed = allowed_tokens(masks, logits.shape[1]).to(logits.device)
        idx = torch.tensor(rows, device=logits.device)
        masked = logits.clone()
        masked[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        for j, row in enumerate(rows):
            r = requests[row]
            if r.num_output_tokens < r.sampling.min_tokens and bool(
                    torch.isneginf(masked[row]).all()):
                # NOTE: min_tokens banned the only tokens the grammar allows (its end): the
                # grammar wins, or the row would have nothing to sample.
                masked[row] = before_min_tokens[row].masked_fill(~allowed[j], float("-inf"))
        return masked

    # ---- sampling ------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, requests: Rows) -> torch.Tensor:
        greedy = cpu_ops.argmax(logits)  # NOTE: torch's argmax where the C kernel does not fit
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not random_rows:
            return greedy
        idx = torch.tensor(random_rows, device=self.device)
        probs = self.probs(logits[idx], [requests[i].sampling for i in random_rows])
        # NOTE: argmax(p / q) with q ~ Exp(1) draws exactly from p (the exponential race).
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, i in enumerate(random_rows):
            gen = requests[i].generator
            if gen is not None:
                q[row].exponential_(generator=gen)
        greedy[idx] = cpu_ops.argmax(probs / q)
        return greedy

    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k, top-p, min-p applied.

        logits: [rows, vocab] (penalties already applied) -> probabilities [rows, vocab].
        """
        temps = torch.tensor([s.temperature for s in params], device=self.device)
        x = logits / temps[:, None]
        x = _top_k_top_p(x, [s.top_k for s in params], [s.top_p for s in params])
        probs = x.softmax(dim=-1)
        min_p = [s.min_p for s in params]
        if any(min_p):
            floor = torch.tensor(min_p, device=self.device)[:, None] * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def verify(self, logits: torch.Tensor, req: SamplingRow) -> tuple[list[int], int]:
        """Check req.spec_token_ids against the target's logits at their positions.

        logits: [gamma + 1, vocab]; returns (the accepted drafts, the token after them).
        """
        s = req.sampling
        if req.grammar_mask is not None:
            logits = self._mask_drafts(logits, req.grammar_mask)
        target = logits if s.greedy else self.probs(logits, [s] * logits.shape[0])
        draft = req.spec_token_ids
        n, token = verify_drafts(draft, target, req.spec_draft_probs, s.greedy,
                                 req.generator or self.generator)
        return draft[:n], token

    def _mask_drafts(self, logits: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
        """Mask each verified position with the grammar's state after the drafts before it
        (mask row i).

        Rows past the first draft the grammar refuses stay unmasked: that draft has
        probability 0 under its masked row, so verification stops there.
        """
        rows = mask.shape[0]
        allowed = allowed_tokens(mask, logits.shape[1]).to(logits.device)
        logits = logits.clone()
        logits[:rows] = logits[:rows].masked_fill(~allowed, float("-inf"))
        return logits

    def _logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, requests: Rows
    ) -> list[PositionLogprobs | None]:
        wanted = [_logprobs_wanted(r) for r in requests]
        if all(n is None for n in wanted):
            return [None] * len(requests)
        return position_logprobs(raw, token_ids, wanted)


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab] from an int32 allowed-token bitmask [rows, ceil(vocab / 32)]."""
    # NOTE: little-endian bit order within each int32 word = token order within bytes
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)


def position_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                      wanted: Sequence[int | None]) -> list[PositionLogprobs | None]:
    """Per row: the logprob and rank of token_ids[row] and the top wanted[row] alternatives
    (None where wanted is None), from the raw logits [rows, vocab].

    NOTE: logprobs of the model's own distribution, before penalties and temperature.
    """
    lp = raw.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    k = max(n or 0 for n in wanted)
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    out: list[PositionLogprobs | None] = []
    for i, n in enumerate(wanted):
        if n is None:
            out.append(None)
            continue
        top = [TokenLogprob(int(t), float(v)) for t, v in
               zip(top_i[i, :n].tolist(), top_v[i, :n].tolist(), strict=True)] if n else []
        out.append(PositionLogprobs(int(token_ids[i]), float(chosen[i]), int(ranks[i]), top))
    return out


def _logprobs_wanted(r: SamplingRow) -> int | None:
    s = r.sampling
    if s.use_beam_search:
        return 2 * s.n  # NOTE: 2k candidates per beam always leave k that do not end
    if s.logprobs is None and s.best_of:
        return 0  # NOTE: best_of ranks choices by their summed logprobs: the sampled one
    return s.logprobs


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p nucleus."""
    vocab = x.shape[1]
    ks = [k if k > 0 else vocab for k in top_k]
    if all(k >= vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=x.device)[None, :]
    drop = positions >= torch.tensor(ks, device=x.device)[:, None]
    if any(p < 1.0 for p in top_p):
        probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop |= before >= torch.tensor(top_p, device=x.device)[:, None]
    # NOTE: the most likely token always stays: a tiny top_p (1e-300 is 0 in float32) would
    # otherwise mask the whole row, and softmax of a row of -inf is NaN.
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)
