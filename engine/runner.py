"""Model runner: flattens a scheduled batch into one varlen token stream, runs the model over
the paged KV cache and samples one token for each request that caught up.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from engine.forward_context import ForwardContext, forward_context
from engine.models.llama import LlamaForCausalLM
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, position_logprobs
from engine.scheduler import SchedulerOutput
from ipc.messages import PositionLogprobs
from kernels import AttentionMetadata

# NOTE: prompt logits go through the LM head this many rows at a time (a [rows, vocab]
# float32 block: 256 x 49152 is 50 MB)
_PROMPT_LOGITS_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        sampler: Sampler,
        backend: ModuleType,
        device: torch.device,
        kv_dtype: torch.dtype,
        num_cpu_blocks: int = 0,
        draft_layers: int | None = None,
        draft_model: LlamaForCausalLM | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.sampler = sampler
        self.backend = backend
        self.device = device
        self.kv_caches, self.cpu_caches = _caches(model.cfg, num_blocks, block_size,
                                                  num_cpu_blocks, kv_dtype, device)
        model.init_rope(max_model_len, device)
        # The draft proposer: the target's first layers sharing its caches (self), or a
        # smaller model with caches of its own under the same block tables (draft).
        self.draft = Draft(model, self.kv_caches, self.cpu_caches, draft_layers, False)
        if draft_model is not None:
            caches, cpu = _caches(draft_model.cfg, num_blocks, block_size, num_cpu_blocks,
                                  kv_dtype, device)
            draft_model.init_rope(max_model_len, device)
            self.draft = Draft(draft_model, caches, cpu, None, True)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        k = self.kv_caches[0][0]
        return 2 * len(self.kv_caches) * k[0].numel() * k.element_size()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput | None:
        self._copy_blocks(out.block_copies)
        if out.empty:
            return None
        if out.drafts:
            self._propose(out.drafts)
        items = [(r, (r.all_token_ids + r.spec_token_ids)[r.num_computed_tokens:][:n])
                 for r, n in out.scheduled]
        input_ids, positions, meta, last = self._prepare(items)
        with forward_context(ForwardContext(meta, self.kv_caches, self.backend)):
            hidden = self.model(input_ids, positions)
        if self.draft.own_cache:  # NOTE: the draft model computes what the target did
            with forward_context(ForwardContext(meta, self.draft.kv_caches, self.backend)):
                self.draft.model(input_ids, positions)
        prompt = self._prompt_logprobs(out, hidden, last)
        if not out.sampling:
            return SamplerOutput([], [], prompt_logprobs=prompt) if prompt else None
        result = self._sample(out, hidden, last)
        result.prompt_logprobs = prompt
        return result

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor,
                         last: dict[int, int]) -> list[tuple[Request, list[PositionLogprobs]]]:
        """Logprobs of the prompt tokens this step's positions predict, for requests that
        asked (position i's logits give prompt token i + 1)."""
        found = []
        for req, n in out.scheduled:
            positions = req.prompt_logprob_positions(req.num_computed_tokens, n)
            if not positions:
                continue
            row0 = last[id(req)] - n + 1 - req.num_computed_tokens  # the row of position 0
            tokens = req.all_token_ids
            k = req.sampling.prompt_logprobs
            computed: list[PositionLogprobs] = []
            for start in range(positions.start, positions.stop, _PROMPT_LOGITS_ROWS):
                span = range(start, min(start + _PROMPT_LOGITS_ROWS, positions.stop))
                rows = torch.tensor([row0 + p for p in span], device=self.device)
                targets = torch.tensor([tokens[p + 1] for p in span], device=self.device)
                logits = self.model.compute_logits(hidden[rows])
                computed += position_logprobs(logits, targets, [k] * len(span))  # type: ignore[arg-type]
            found.append((req, computed))
        return found

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor, last: dict[int, int]):
        """Sample plain requests in one batch; verify each speculating request's drafts."""
        plain = [i for i, r in enumerate(out.sampling) if not r.spec_token_ids]
        rows = [last[id(out.sampling_rows[i])] for i in plain]
        spans = []  # (index, first row): gamma + 1 positions from the last real token
        for i, r in enumerate(out.sampling):
            if r.spec_token_ids:
                spans.append((i, len(rows)))
                end = last[id(r)]
                rows.extend(range(end - len(r.spec_token_ids), end + 1))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        result = self.sampler(logits[: len(plain)], [out.sampling[i] for i in plain])
        tokens = dict(zip(plain, result.token_ids, strict=True))
        logprobs = dict(zip(plain, result.logprobs, strict=True))
        accepted: dict[int, list[int]] = {}
        for i, start in spans:
            r = out.sampling[i]
            block = logits[start : start + len(r.spec_token_ids) + 1]
            accepted[i], tokens[i] = self.sampler.verify(block, r)
        n = len(out.sampling)
        return SamplerOutput([tokens[i] for i in range(n)], [logprobs.get(i) for i in range(n)],
                             [accepted.get(i, []) for i in range(n)])

    def _propose(self, drafts: list[tuple[Request, int]]) -> None:
        """Propose each request's draft tokens, one draft forward per position.

        NOTE: the self draft's layers are the target's, so it shares the target's KV cache:
        what it writes for accepted positions the target writes again when it verifies them.
        """
        draft = self.draft
        reqs = [r for r, _ in drafts]
        cur = [r.all_token_ids[-1] for r in reqs]  # the newest token, not yet in the cache
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        for j in range(max(g for _, g in drafts)):
            active = [i for i, (_, g) in enumerate(drafts) if g > j]
            items = [(reqs[i], [cur[i]]) for i in active]
            input_ids, positions, meta, last = self._prepare(items, offset=j)
            with forward_context(ForwardContext(meta, draft.kv_caches, self.backend)):
                hidden = draft.model(input_ids, positions, num_layers=draft.num_layers)
            logits = draft.model.compute_logits(hidden)
            for row, i in enumerate(active):
                s = reqs[i].sampling
                if s.greedy:
                    token = int(logits[row].argmax())
                else:
                    p = self.sampler.probs(logits[row : row + 1], [s])[0]
                    token = int(torch.multinomial(p, 1, generator=reqs[i].generator
                                                  or self.sampler.generator))
                    probs[i].append(p)
                tokens[i].append(token)
                cur[i] = token
        for i, r in enumerate(reqs):
            r.spec_token_ids = tokens[i]
            r.spec_draft_probs = torch.stack(probs[i]) if probs[i] else None

    def _copy_blocks(self, copies: list[tuple[str, int, int]]) -> None:
        """Run swap-out, swap-in and copy-on-write copies in the order they were decided."""
        if copies and hasattr(self.model, "copy_blocks"):
            self.model.copy_blocks(copies)  # NOTE: tensor-parallel workers copy their shards
        start = 0
        while start < len(copies):
            kind = copies[start][0]
            end = start
            while end < len(copies) and copies[end][0] == kind:
                end += 1
            # NOTE: within a run of one kind no copy reads another's destination, so a run
            # can go as one indexed copy per layer.
            src = torch.tensor([c[1] for c in copies[start:end]])
            dst = torch.tensor([c[2] for c in copies[start:end]])
            sets = [(self.kv_caches, self.cpu_caches)]
            if self.draft.own_cache:
                sets.append((self.draft.kv_caches, self.draft.cpu_caches))
            for gpu, cpu in sets:
                pools = {"gpu_to_gpu": (gpu, gpu), "gpu_to_cpu": (gpu, cpu),
                         "cpu_to_gpu": (cpu, gpu)}[kind]
                for (src_k, src_v), (dst_k, dst_v) in zip(*pools, strict=True):
                    for src_cache, dst_cache in ((src_k, dst_k), (src_v, dst_v)):
                        rows = src_cache[src.to(src_cache.device)]
                        dst_cache[dst.to(dst_cache.device)] = rows.to(dst_cache.device)
            start = end

    def _prepare(self, items: list[tuple[Request, list[int]]], offset: int = 0):
        """One varlen batch: each request's new tokens, starting at num_computed + offset.

        Returns input ids, positions, attention metadata, and {id(request): index of its last
        token in the batch}.
        """
        reqs = [r for r, _ in items]
        query_lens = np.array([len(t) for _, t in items], dtype=np.int64)
        computed = np.array([r.num_computed_tokens + offset for r in reqs], dtype=np.int64)
        seq_lens = computed + query_lens
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        ids = [t for _, tokens in items for t in tokens]
        seq_of_token = np.repeat(np.arange(len(reqs)), query_lens)
        positions = np.arange(num_tokens) - qsl[:-1][seq_of_token] + computed[seq_of_token]

        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_ids)] = r.block_ids[:max_blocks]
        # NOTE: blocks released behind a sliding window (NULL_BLOCK) read as block 0: a valid
        # id, always masked out
        np.maximum(tables, 0, out=tables)
        slots = (tables[seq_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)

        num_decodes = int(np.count_nonzero(query_lens == 1))
        last_token = {id(r): int(qsl[i + 1]) - 1 for i, r in enumerate(reqs)}
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev, torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(dev, torch.int32),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            num_decodes=num_decodes,
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_decode_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, last_token


@dataclass
class Draft:
    model: LlamaForCausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    cpu_caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_layers: int | None  # the self draft runs the target's first layers only
    own_cache: bool  # a separate draft model: it must also compute every token the target does


def _caches(cfg, num_blocks: int, block_size: int, num_cpu_blocks: int, dtype: torch.dtype,
            device: torch.device):
    """Per-layer (K, V) pools on the device and, for swapping, in host memory."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    # NOTE: zeros, not empty: masked-out slots are multiplied by 0 and must not hold NaN.
    # On the CPU, zero_() writes every page now: calloc leaves them unmapped, and the first
    # steps would otherwise pay the page faults (the pool is the KV budget, held from start).
    gpu = [(torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
    if device.type == "cpu":
        for pair in gpu:
            for cache in pair:
                cache.zero_()
    # The swap pool: host memory (pinned on a GPU machine so copies can overlap).
    # NOTE: empty, not zeros: a CPU block is only read after a swap-out wrote it, and
    # untouched pages of an empty tensor cost no memory.
    pin = device.type == "cuda"
    cpu_shape = (num_cpu_blocks, *shape[1:])
    cpu = [(torch.empty(cpu_shape, dtype=dtype, pin_memory=pin),
            torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))
           for _ in range(cfg.num_layers if num_cpu_blocks else 0)]
    return gpu, cpu
