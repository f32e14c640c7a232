"""EngineCore: requests in, token deltas out; `step()` is schedule -> execute -> update.

It touches no sockets: the engine process (IO threads) and `LLM` (in-process) both drive it.
What it is made of is engine/build.py; how a request is checked and made, engine/admission.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.admission import Admission
from engine.build import build
from ipc.config import EngineConfig
from ipc.limits import Limits
from ipc.messages import AddRequest, EngineStats, TokenDelta

if TYPE_CHECKING:
    from engine.run.lora.slots import LoraSlots

_GRAMMAR_POLL_S = 0.005  # longest wait for a compiling grammar when nothing else can run


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """Its parts built (engine/build.py: numerics, backend, model, draft, KV pool,
        scheduler, runner), then kept as attributes: the loop (engine.process.Core), LLM and
        tests read them."""
        self.config = config
        parts = build(config)
        self.device, self.dtype, self.kv_dtype = parts.device, parts.dtype, parts.kv_dtype
        self.quantization, self.numerics = parts.quantization, parts.numerics
        self.attention_backend, self.cpu_linear = parts.attention_backend, parts.cpu_linear
        self.model_name, self.tokenizer_dir = parts.model_name, parts.tokenizer_dir
        self.model_config, self.num_params = parts.model_config, parts.num_params
        self.eos_token_ids, self.pooling_info = parts.eos_token_ids, parts.pooling_info
        self.block_size, self.max_model_len = config.block_size, parts.max_model_len
        self.num_gpu_blocks, self.num_cpu_blocks = parts.num_gpu_blocks, parts.num_cpu_blocks
        self.block_bytes = parts.block_bytes
        self.kv, self.scheduler, self.runner = parts.kv, parts.scheduler, parts.runner
        self.lora, self.grammars = parts.lora, parts.grammars
        limits = Limits(self.max_model_len, config.max_logprobs, self.model_config.vocab_size,
                        parts.context_note)
        self.admission = Admission(limits, self.num_gpu_blocks, self.kv, self.scheduler,
                                   self.model_config, self.pooling_info, self.grammars,
                                   self.lora)
        self.step_count = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_logprobs(self) -> int:
        return self.config.max_logprobs

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request; bad input raises ValueError and leaves the engine as it was."""
        self.scheduler.add(self.admission.request(msg))

    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        """Idempotent; one terminal 'abort' delta per choice of each request still live."""
        return self.scheduler.abort(request_ids)

    def abort_choice(self, request_id: str, index: int) -> list[TokenDelta]:
        """Stop one choice of an n > 1 request (it matched a stop string); idempotent."""
        return self.scheduler.abort([request_id], index)

    def load_lora(self, name: str, path: str) -> list[str]:
        """Load a PEFT adapter under `name`; the adapters loaded. ValueError names the fault."""
        if self.lora is None:
            raise ValueError("LoRA is off: start the engine with --enable-lora")
        self.lora.add(name, path)
        return sorted(self.lora.paths)

    def unload_lora(self, name: str) -> list[str]:
        """Unload the adapter (its host copy and slot are freed); the adapters left."""
        if self.lora is None or name not in self.lora.paths:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        lora_id = self.lora.id_of(name)
        users = sum(r.lora_id == lora_id for g in self.scheduler.groups.values() for r in g)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} running requests")
        self.lora.remove(name)
        return sorted(self.lora.paths)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenDelta]:
        deltas = self.scheduler.admit_compiled()
        plan = self.scheduler.schedule()
        if plan.empty and not plan.block_copies:
            if plan.finished_keys:
                self.runner.execute(plan)  # NOTE: nothing to run; the runner drops the rows
            elif not deltas:  # NOTE: only grammars compiling: wait for one, not spinning
                self.scheduler.wait_for_grammar(_GRAMMAR_POLL_S)
            return deltas
        self.step_count += 1
        if plan.self_drafts:
            # NOTE: two phases in one step: the runner's draft proposes, the scheduler turns
            # the proposals into the plan's drafts (and grammar masks), the target verifies
            self.scheduler.attach_drafts(plan, self.runner.propose(plan))
        output = self.runner.execute(plan)
        self._prompt_tokens += plan.num_prompt_tokens
        self._generation_tokens += len(plan.sampling)
        return deltas + self.scheduler.update(plan, output)

    def cached_block_hashes(self) -> list[bytes]:
        """Hashes of the blocks in the prefix cache (reported to the gateway for routing)."""
        return list(self.kv.pool.cached)

    def stats(self) -> EngineStats:
        p, spec, g = self.scheduler.preemptions, self.scheduler.spec_stats, self.grammars.stats
        return EngineStats(
            step=self.step_count,
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.num_gpu_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            num_swapped=len(self.scheduler.swapped),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions_swap=p.swap,
            num_preemptions_recompute=p.recompute,
            swap_out_bytes=p.swap_out_blocks * self.block_bytes,
            swap_in_bytes=p.swap_in_blocks * self.block_bytes,
            kv_cpu_blocks_total=self.num_cpu_blocks,
            kv_cpu_blocks_free=self.kv.num_free_cpu_blocks,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_verify_steps=spec.verify_steps,
            spec_accepted_by_position=list(spec.accepted_by_position),
            grammar_compiles=g.compiles,
            grammar_cache_hits=g.cache_hits,
            grammar_waits=g.waited,
            grammar_failures=g.failures,
            grammar_compile_seconds_sum=g.compile_seconds_sum,
            grammar_compile_seconds_buckets=list(g.compile_seconds_buckets),
            **_lora_stats(self.lora),
        )


def _lora_stats(lora: LoraSlots | None) -> dict[str, int]:
    if lora is None:
        return {}
    return {"lora_adapters": len(lora.paths), "lora_slots_total": lora.limits.max_loras,
            "lora_slots_used": lora.num_slots_used, "lora_cpu_bytes": lora.cpu_bytes}
