"""Model runner: applies each step plan to its rows, flattens the scheduled tokens into one
varlen stream (decodes first), runs the model over the paged KV cache, and returns the sampled
tokens as plain data (engine.step_plan.RunnerOutput).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.allocator import untouched_zeros
from engine.models.forward_context import ForwardContext, forward_context
from engine.models.llama import LlamaForCausalLM
from engine.run.lora.slots import LoraSlots
from engine.run.pooling import Pooler
from engine.run.rows import Row, RowStates
from engine.run.sampler import Sampler, position_logprobs
from engine.step_plan import (
    BlockCopy,
    CopyKind,
    DraftProposals,
    RunnerOutput,
    Sampled,
    StepPlan,
    decode_first,
)
from ipc.messages import PositionLogprobs
from kernels import AttentionMetadata, Backend
from kernels.cpu import ops as cpu_ops

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
        backend: Backend,
        device: torch.device,
        kv_dtype: torch.dtype,
        num_cpu_blocks: int = 0,
        draft_layers: int | None = None,
        draft_model: LlamaForCausalLM | None = None,
        lora: LoraSlots | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.batch_invariant = batch_invariant  # AttentionMetadata.invariant of every step
        self.lora = lora  # the adapters' slots, when LoRA is on (engine/run/lora)
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.sampler = sampler
        self.backend = backend
        self.device = device
        self.states = RowStates(self.max_blocks_per_seq, device)
        # embedding rows' running pools across prompt chunks (a cross-encoder's: its head)
        self.pooler = Pooler(model.score)
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

    def _apply_plan(self, plan: StepPlan) -> None:
        """The plan's request entries and block copies, once per plan (propose and execute
        both come here first)."""
        if plan.step == self.states.applied_step:
            return
        self.states.apply(plan)
        self.pooler.drop(plan.finished_keys)
        self._copy_blocks(plan.block_copies)

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> DraftProposals:
        """Phase one of a self-draft step: the draft's tokens for each of plan.self_drafts."""
        self._apply_plan(plan)
        rows = self.states.rows
        drafts = [(rows[key], gamma) for key, gamma in plan.self_drafts.items()]
        return DraftProposals(self._propose(drafts) if drafts else {})

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        self._apply_plan(plan)
        if plan.empty:
            return RunnerOutput()
        self.states.set_step_inputs(plan)
        rows = [self.states.rows[key] for key in decode_first(plan)]
        counts = plan.num_scheduled_tokens
        items = [(r, (r.token_ids + r.spec_token_ids)[r.num_computed_tokens:][:counts[r.key]])
                 for r in rows]
        input_ids, positions, meta, last = self._prepare(items)
        lora = None if self.lora is None else self.lora.batch((r.lora, len(t)) for r, t in items)
        with forward_context(ForwardContext(meta, self.kv_caches, self.backend, lora)):
            hidden = self.model(input_ids, positions)
        if self.draft.own_cache:  # NOTE: the draft model computes what the target did
            with forward_context(ForwardContext(meta, self.draft.kv_caches, self.backend)):
                self.draft.model(input_ids, positions)
        prompt = self._prompt_logprobs(plan, hidden, last)
        sampled = self._sample(plan, hidden, last) if plan.sampling else {}
        pooled = self.pooler.step(plan, self.states.rows, hidden, last)  # type: ignore[arg-type]
        return RunnerOutput(sampled, prompt, pooled)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor,
                         last: dict[str, int]) -> dict[str, list[PositionLogprobs]]:
        """Logprobs of the prompt tokens this step's positions predict, for requests that
        asked (position i's logits give prompt token i + 1)."""
        found = {}
        for key, span in plan.prompt_logprobs.items():
            row = self.states.rows[key]
            n = plan.num_scheduled_tokens[key]
            row0 = last[key] - n + 1 - row.num_computed_tokens  # the row of position 0
            tokens = row.token_ids
            computed: list[PositionLogprobs] = []
            for start in range(span.start, span.stop, _PROMPT_LOGITS_ROWS):
                positions = range(start, min(start + _PROMPT_LOGITS_ROWS, span.stop))
                idx = torch.tensor([row0 + p for p in positions], device=self.device)
                targets = torch.tensor([tokens[p + 1] for p in positions], device=self.device)
                logits = self.model.compute_logits(hidden[idx])
                computed += position_logprobs(logits, targets, [span.k] * len(positions))  # type: ignore[arg-type]
            found[key] = computed
        return found

    def _sample(self, plan: StepPlan, hidden: torch.Tensor,
                last: dict[str, int]) -> dict[str, Sampled]:
        """Sample plain rows in one batch; verify each speculating row's drafts."""
        rows = [self.states.rows[r.key] for r in plan.sampling]
        plain = [i for i, r in enumerate(rows) if not r.spec_token_ids]
        hidden_rows = [last[plan.sampling[i].logits_key] for i in plain]
        spans = []  # (index, first row): gamma + 1 positions from the last real token
        for i, r in enumerate(rows):
            if r.spec_token_ids:
                spans.append((i, len(hidden_rows)))
                end = last[r.key]
                hidden_rows.extend(range(end - len(r.spec_token_ids), end + 1))
        if hidden_rows != list(range(len(hidden))):  # NOTE: a plain decode step takes all
            hidden = hidden[torch.tensor(hidden_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        result = self.sampler(logits[: len(plain)], [rows[i] for i in plain])
        out: dict[str, Sampled] = {}
        for i, token, logprobs in zip(plain, result.token_ids, result.logprobs, strict=True):
            out[rows[i].key] = Sampled(token, [], logprobs)
        for i, start in spans:
            r = rows[i]
            block = logits[start : start + len(r.spec_token_ids) + 1]
            accepted, token = self.sampler.verify(block, r)
            out[r.key] = Sampled(token, accepted, None)
        return {r.key: out[r.key] for r in rows}

    def _propose(self, drafts: list[tuple[Row, int]]) -> dict[str, list[int]]:
        """Propose each row's draft tokens, one draft forward per position; their draft
        probabilities stay on the row for verification.

        NOTE: the self draft's layers are the target's, so it shares the target's KV cache:
        what it writes for accepted positions the target writes again when it verifies them.
        """
        draft = self.draft
        rows = [r for r, _ in drafts]
        cur = [r.token_ids[-1] for r in rows]  # the newest token, not yet in the cache
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        tokens: list[list[int]] = [[] for _ in rows]
        for j in range(max(g for _, g in drafts)):
            active = [i for i, (_, g) in enumerate(drafts) if g > j]
            items = [(rows[i], [cur[i]]) for i in active]
            input_ids, positions, meta, last = self._prepare(items, offset=j)
            with forward_context(ForwardContext(meta, draft.kv_caches, self.backend)):
                hidden = draft.model(input_ids, positions, num_layers=draft.num_layers)
            logits = draft.model.compute_logits(hidden)
            for row, i in enumerate(active):
                s = rows[i].sampling
                if s.greedy:
                    token = int(cpu_ops.argmax(logits[row : row + 1])[0])
                else:
                    p = self.sampler.probs(logits[row : row + 1], [s])[0]
                    token = int(torch.multinomial(p, 1, generator=rows[i].generator
                                                  or self.sampler.generator))
                    probs[i].append(p)
                tokens[i].append(token)
                cur[i] = token
        for i, r in enumerate(rows):
            r.spec_draft_probs = torch.stack(probs[i]) if probs[i] else None
        return {r.key: tokens[i] for i, r in enumerate(rows)}

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run swap-out, swap-in and copy-on-write copies in the order they were decided."""
        start = 0
        while start < len(copies):
            kind = copies[start].kind
            end = start
            while end < len(copies) and copies[end].kind == kind:
                end += 1
            # NOTE: within a run of one kind no copy reads another's destination, so a run
            # can go as one indexed copy per layer.
            src = torch.tensor([c.src for c in copies[start:end]])
            dst = torch.tensor([c.dst for c in copies[start:end]])
            sets = [(self.kv_caches, self.cpu_caches)]
            if self.draft.own_cache:
                sets.append((self.draft.kv_caches, self.draft.cpu_caches))
            for gpu, cpu in sets:
                pools = {CopyKind.GPU_TO_GPU: (gpu, gpu), CopyKind.GPU_TO_CPU: (gpu, cpu),
                         CopyKind.CPU_TO_GPU: (cpu, gpu)}[kind]
                for (src_k, src_v), (dst_k, dst_v) in zip(*pools, strict=True):
                    for src_cache, dst_cache in ((src_k, dst_k), (src_v, dst_v)):
                        rows = src_cache[src.to(src_cache.device)]
                        dst_cache[dst.to(dst_cache.device)] = rows.to(dst_cache.device)
            start = end

    def _prepare(self, items: list[tuple[Row, list[int]]], offset: int = 0):
        """One varlen batch: each row's new tokens, starting at num_computed + offset (rows
        come decodes first).

        Returns input ids, positions, attention metadata, and {key: index of its last token in
        the batch}.
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
        tables = self.states.tables(reqs, max_blocks)
        slots = (tables[seq_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)

        num_decodes = int(np.count_nonzero(query_lens == 1))
        last_token = {r.key: int(qsl[i + 1]) - 1 for i, r in enumerate(reqs)}
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
            invariant=self.batch_invariant,
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
    # On the CPU the zeros are untouched anonymous pages (engine/allocator.py): resident as
    # they are written, so an idle or lightly used pool costs no memory. The first write of
    # each 4 KiB page pays a fault (about 2.3 us here: 0.9 ms per 1.5 MiB layer tensor), i.e.
    # about 1.6 ms per 128-token prompt on the bundled model's float16 pool, over the steps.
    if device.type == "cpu":
        pools = untouched_zeros(2 * cfg.num_layers, shape, dtype)
        gpu = list(zip(pools[0::2], pools[1::2], strict=True))
    else:
        gpu = [(torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
    # The swap pool: host memory (pinned on a GPU machine so copies can overlap).
    # NOTE: empty, not zeros: a CPU block is only read after a swap-out wrote it, and
    # untouched pages of an empty tensor cost no memory.
    pin = device.type == "cuda"
    cpu_shape = (num_cpu_blocks, *shape[1:])
    cpu = [(torch.empty(cpu_shape, dtype=dtype, pin_memory=pin),
            torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))
           for _ in range(cfg.num_layers if num_cpu_blocks else 0)]
    return gpu, cpu
