"""Model runner: flattens a scheduled batch into one varlen token stream, runs the model over
the paged KV cache and samples one token for each request that caught up.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from engine.forward_context import ForwardContext, forward_context
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput
from kernels import AttentionMetadata


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
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.sampler = sampler
        self.backend = backend
        self.device = device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: zeros, not empty: masked-out slots are multiplied by 0 and must not hold NaN.
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device),
             torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        # The swap pool: host memory (pinned on a GPU machine so copies can overlap).
        # NOTE: empty, not zeros: a CPU block is only read after a swap-out wrote it, and
        # untouched pages of an empty tensor cost no memory.
        pin = device.type == "cuda"
        self.cpu_caches = [
            (torch.empty((num_cpu_blocks, *shape[1:]), dtype=kv_dtype, pin_memory=pin),
             torch.empty((num_cpu_blocks, *shape[1:]), dtype=kv_dtype, pin_memory=pin))
            for _ in range(cfg.num_layers if num_cpu_blocks else 0)
        ]
        model.init_rope(max_model_len, device)

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
        input_ids, positions, meta, logits_indices = self._prepare(out)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        if not out.sampling:
            return None
        logits = self.model.compute_logits(hidden[logits_indices])
        return self.sampler(logits, out.sampling)

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
            pools = {
                "gpu_to_gpu": (self.kv_caches, self.kv_caches),
                "gpu_to_cpu": (self.kv_caches, self.cpu_caches),
                "cpu_to_gpu": (self.cpu_caches, self.kv_caches),
            }[kind]
            for (src_k, src_v), (dst_k, dst_v) in zip(*pools, strict=True):
                for src_cache, dst_cache in ((src_k, dst_k), (src_v, dst_v)):
                    rows = src_cache[src.to(src_cache.device)]
                    dst_cache[dst.to(dst_cache.device)] = rows.to(dst_cache.device)
            start = end

    def _prepare(self, out: SchedulerOutput):
        reqs = [r for r, _ in out.scheduled]
        query_lens = np.array([n for _, n in out.scheduled], dtype=np.int64)
        computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        seq_lens = computed + query_lens
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        ids: list[int] = []
        for r, n in out.scheduled:
            c = r.num_computed_tokens
            ids.extend(r.all_token_ids[c : c + n])
        seq_of_token = np.repeat(np.arange(len(reqs)), query_lens)
        positions = np.arange(num_tokens) - qsl[:-1][seq_of_token] + computed[seq_of_token]

        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_ids)] = r.block_ids[:max_blocks]
        slots = (tables[seq_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)

        num_decodes = int(np.count_nonzero(query_lens == 1))
        last_token = {id(r): int(qsl[i + 1]) - 1 for i, r in enumerate(reqs)}
        logits_indices = [last_token[id(r)] for r in out.sampling_rows]
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
        return (input_ids, torch.from_numpy(positions).to(dev), meta,
                torch.tensor(logits_indices, dtype=torch.long, device=dev))
