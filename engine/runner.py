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
        model.init_rope(max_model_len, device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput | None:
        input_ids, positions, meta, logits_indices = self._prepare(out)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        if not out.sampling:
            return None
        logits = self.model.compute_logits(hidden[logits_indices])
        return self.sampler(logits, out.sampling)

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
        sampling = {id(r) for r in out.sampling}
        logits_indices = [int(qsl[i + 1]) - 1 for i, r in enumerate(reqs) if id(r) in sampling]
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
