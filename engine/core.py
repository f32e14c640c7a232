"""EngineCore: requests in, token deltas out; `step()` is schedule -> execute -> update.

It touches no sockets: the engine process (IO threads) and `LLM` (in-process) both drive it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

from engine.allocator import tune_malloc
from engine.devices import resolve_device, resolve_dtype
from engine.models.accelerate import accelerate
from engine.models.config import ModelConfig, from_hf_config
from engine.models.loader import load_model, resolve_quantization
from engine.models.numerics import resolve_kv_dtype, resolve_numerics
from engine.models.pooling_config import pooling_info
from engine.models.quant_linear import count_weights
from engine.run.lora.slots import LoraLimits, LoraSlots
from engine.run.runner import ModelRunner
from engine.run.sampler import Sampler
from engine.sched.kv_manager import KVCacheManager
from engine.sched.preemption import PreemptionCost
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerConfig, SpecConfig
from engine.sched.structured.compiler import GrammarCompiler
from engine.step_plan import choice_key
from engine.tokenizer import tokenizer_dir
from ipc.config import EngineConfig, prefill_tokens_while_decoding, step_token_budget
from ipc.limits import Limits, check_limits, check_pooling_input
from ipc.messages import AddRequest, EngineStats, TokenDelta
from ipc.model_source import ModelSource, resolve_model
from ipc.pooling import PoolingInfo, PoolingParams
from ipc.prefix_hash import salt_bytes
from kernels import Backend, auto_backend, get_backend

if TYPE_CHECKING:
    from engine.parallel.driver import Ranks, TensorParallelRunner

# auto: the model's dtype
_KV_CACHE_DTYPES = {"float16": torch.float16, "half": torch.float16,
                    "fp8_e4m3": torch.float8_e4m3fn}
# NOTE: a pool smaller than this cannot hold a useful request: refuse to start.
_MIN_CONTEXT_TOKENS = 16

log = logging.getLogger(__name__)
_GRAMMAR_POLL_S = 0.005  # longest wait for a compiling grammar when nothing else can run


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """Built in stages: the numerics (auto resolved), the attention backend (refused
        before anything loads), the model (loaded, then its fast paths installed), the KV
        pool's size, the scheduler, the runner."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        source = resolve_model(config.model, config.served_model_name)
        self._resolve_numerics(config, source)
        backend = self._attention_backend(config)
        model, ranks = self._build_model(config, source)
        # NOTE: from the memory the target model leaves (on CUDA), before the draft loads
        self.num_gpu_blocks = self._num_blocks()
        draft_model = self._draft_model(config)
        self.cpu_linear = self._accelerate(backend, model, draft_model)
        step_tokens = step_token_budget(config, self.device.type)
        self._size_kv(config, draft_model, step_tokens)
        self.scheduler = self._build_scheduler(config, step_tokens)
        self.runner = self._build_runner(config, backend, model, draft_model, ranks)
        if self.device.type == "cpu":
            tune_malloc()  # NOTE: after loading and packing (engine/allocator.py says why)
        vocab = self.model_config.vocab_size
        self.grammars = GrammarCompiler(
            lambda: _lltokenizer(self.tokenizer_dir, vocab, self.eos_token_ids),
            config.structured_output_compile_timeout,
            close_on_budget=config.structured_output_close_on_budget)
        self.step_count = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_logprobs(self) -> int:
        return self.config.max_logprobs

    # ---- build stages --------------------------------------------------------------------------

    def _resolve_numerics(self, config: EngineConfig, source: ModelSource) -> None:
        """The concrete quantization, numerics and KV dtype (every auto resolved:
        engine/models/numerics.py), logged."""
        self.quantization = resolve_quantization(config.quantization, source, self.dtype,
                                                 self.device, config.tensor_parallel_size)
        self.numerics = resolve_numerics(config.quantization_numerics, self.quantization)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.numerics, self.dtype)
        log.info("numerics: quantization %s, products %s, KV cache %s", self.quantization,
                 self.numerics if self.quantization != "none" else "dense",
                 str(self.kv_dtype).removeprefix("torch."))

    def _attention_backend(self, config: EngineConfig) -> Backend:
        """The backend that runs (auto resolved here), checked before any model loads."""
        self.attention_backend = (auto_backend(self.device.type, self.kv_dtype == self.dtype)
                                  if config.attention_backend == "auto"
                                  else config.attention_backend)
        if self.attention_backend == "flash_attn" and self.kv_dtype != self.dtype:
            # NOTE: asked for by name (auto skips it): at start, not at the first request
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype}: the flash_attn backend "
                             "reads a KV cache of the model's dtype only (use "
                             "--attention-backend triton)")
        return get_backend(self.attention_backend, self.device.type)

    def _build_model(self, config: EngineConfig,
                     source: ModelSource) -> tuple[torch.nn.Module, Ranks | None]:
        """The target model (rank 0's shard under tensor parallelism) and the other ranks;
        sets its names, config, context length and weight count."""
        self.model_name = source.name
        self.tokenizer_dir = str(tokenizer_dir(source, config.tokenizer))
        model, self.model_config, ranks = _load_model(config, source, self.dtype, self.device,
                                                      self.quantization, self.numerics)
        self.max_model_len = _max_model_len(config, self.model_config)
        self.pooling_info: PoolingInfo = pooling_info(
            None if source.is_gguf else source.path, self.model_config.hidden_size,
            config.pooling, self.model_config.num_labels)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        # NOTE: counted before packing: packed (and quantized) weights are not Parameters
        self.num_params = count_weights(model)
        return model, ranks

    def _accelerate(self, backend: Backend, model: torch.nn.Module,
                    draft: torch.nn.Module | None) -> str:
        """Every CPU fast path in the draft model, then the target (engine/models/
        accelerate.py); returns the target's linear mode."""
        if self.config.tensor_parallel_size > 1:
            return "torch"  # NOTE: the ranks hold the weights (EngineConfig refuses others)
        options = {"cpu_linear": self.config.cpu_linear, "fused_cpu_ops": backend.FUSED_CPU_OPS,
                   "device": self.device, "dtype": self.dtype}
        if draft is not None:
            # NOTE: first, as ever: the target's auto mode sees the memory the draft's took
            accelerate(draft, **options)
        return accelerate(model, **options).cpu_linear

    def _size_kv(self, config: EngineConfig, draft: torch.nn.Module | None,
                 step_tokens: int) -> None:
        """The swap pool, the KV manager, and the context one request can really use."""
        self.block_bytes = (self.block_size * self.model_config.kv_bytes_per_token
                            * self.kv_dtype.itemsize)
        self.num_cpu_blocks = int(config.swap_space * 2**30 // self.block_bytes)
        self.kv = KVCacheManager(self.num_gpu_blocks, self.block_size,
                                 config.enable_prefix_caching, self.num_cpu_blocks,
                                 self._kv_window(config, draft))
        model_len = self.max_model_len
        # NOTE: with window freeing a request holds at most its window's blocks, whatever its
        # length; otherwise one block per block_size tokens
        full = self.kv.max_blocks_held(model_len, step_tokens)
        self.max_model_len = _fit_context(model_len, self.num_gpu_blocks, self.block_size, full)
        # NOTE: said in errors, so that a client knows why its context is short
        self._context_note = ("" if self.max_model_len == model_len else
                              f" (what {self.num_gpu_blocks} KV blocks hold)")

    def _build_scheduler(self, config: EngineConfig, step_tokens: int) -> Scheduler:
        preemption = PreemptionCost(self.block_bytes, 2.0 * self.num_params, self.device.type,
                                    config.preemption_mode)
        return Scheduler(
            SchedulerConfig(config.max_num_seqs, step_tokens, self.max_model_len,
                            _spec_config(config, self.model_config.num_layers),
                            self.model_config.vocab_size,
                            config.max_loras if config.enable_lora else None,
                            prefill_tokens_while_decoding(config, self.device.type)),
            self.kv,
            self.eos_token_ids,
            preemption,
        )

    def _build_runner(self, config: EngineConfig, backend: Backend,
                      model: torch.nn.Module, draft: torch.nn.Module | None,
                      ranks: Ranks | None) -> ModelRunner | TensorParallelRunner:
        sampler = Sampler(config.seed, self.device)
        # NOTE: after packing and the fused paths: the adapters wrap whatever linears run
        self.lora = _lora_slots(config, model, self.dtype, self.device)
        runner = ModelRunner(
            model, self.num_gpu_blocks, self.block_size, self.max_model_len, sampler,
            backend, self.device, self.kv_dtype, self.num_cpu_blocks,
            draft_layers=config.speculative_draft_layers, draft_model=draft,
            lora=self.lora, batch_invariant=config.batch_invariant,
        )
        return runner if ranks is None else self._tensor_parallel(runner, ranks)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request; bad input raises ValueError and leaves the engine as it was."""
        request = self._validate(msg)
        self.scheduler.add(request)

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
        self._prompt_tokens += self.scheduler.num_prompt_tokens_in(plan)
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

    # ---- helpers -------------------------------------------------------------------------------

    def _draft_model(self, config: EngineConfig):
        """The separate draft model of --speculative-method draft (it shares the tokenizer)."""
        if config.speculative_method != "draft":
            return None
        source = resolve_model(config.speculative_model)
        mode = resolve_quantization(config.quantization, source, self.dtype, self.device)
        draft, cfg = load_model(source, self.dtype, self.device, mode,
                                resolve_numerics(config.quantization_numerics, mode),
                                config.packed_tile_cache)
        if cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"the speculative model's vocabulary ({cfg.vocab_size}) differs from the "
                f"target's ({self.model_config.vocab_size}): it must share the tokenizer")
        return draft

    def _tensor_parallel(self, runner: ModelRunner, ranks: Ranks) -> TensorParallelRunner:
        """Rank 0's runner, with the other ranks' runners built alike (same sizes, seed)."""
        from engine.parallel.driver import TensorParallelRunner
        from engine.parallel.records import RunnerInit

        init = RunnerInit(self.num_gpu_blocks, self.block_size, self.max_model_len,
                          self.attention_backend, str(self.kv_dtype).removeprefix("torch."),
                          self.num_cpu_blocks, self.config.speculative_draft_layers,
                          self.config.seed, self.config.batch_invariant)
        return TensorParallelRunner(runner, ranks, init)

    def _kv_window(self, config: EngineConfig, draft) -> int | None:
        """The window behind which KV blocks are released: every layer's of the model (and of
        a separate draft model, which shares the block tables) when all have one."""
        window = self.model_config.kv_window if config.enable_window_freeing else None
        if window is not None and draft is not None:
            other = draft.cfg.kv_window
            window = None if other is None else max(window, other)
        return window

    def _validate(self, msg: AddRequest) -> Request:
        if msg.sampling.pooling is not None:
            return self._validate_pooling(msg)
        prompt, s = msg.prompt_token_ids, msg.sampling
        if self.model_config.num_labels is not None:
            raise ValueError("this model is a cross-encoder (a sequence classifier with a score "
                             "head, no LM head): it scores pairs (rerank, score) and does not "
                             "generate")
        keys = [choice_key(msg.request_id, i) for i in range(s.num_choices)]
        if msg.request_id in self.scheduler.groups or any(map(self.scheduler.is_live, keys)):
            raise ValueError(f"request_id {msg.request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt must not be empty")
        check_limits(Limits(self.max_model_len, self.config.max_logprobs,
                            self.model_config.vocab_size, self._context_note), prompt, s)
        max_tokens = self.max_model_len - len(prompt) if s.max_tokens is None else s.max_tokens
        blocks = self.kv.max_blocks_held(len(prompt) + max_tokens,
                                         self.scheduler.config.max_num_batched_tokens)
        if blocks > self.num_gpu_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {blocks} KV blocks; the pool has "
                f"{self.num_gpu_blocks}"
            )
        lora_id = self._lora_id(msg.lora_name)
        salt = salt_bytes(msg.cache_salt, None if lora_id is None else f"{msg.lora_name}#{lora_id}")
        choices = [
            Request(msg.request_id, list(prompt), s, max_tokens, msg.priority,
                    msg.arrival_time or time.time(), salt, index=i)
            for i in range(s.num_choices)
        ]
        for c in choices:
            c.lora_id = lora_id
        choices[0].children = choices[1:]
        if s.structured_outputs is not None:
            choices[0].pending_grammar = self.grammars.submit(s.structured_outputs)
        return choices[0]

    def _validate_pooling(self, msg: AddRequest) -> Request:
        """A prefill-only request: its prompt must fit the context and the pool; its pooling
        gets the model's method and normalization where it set none."""
        prompt, s, info = msg.prompt_token_ids, msg.sampling, self.pooling_info
        assert s.pooling is not None
        if msg.request_id in self.scheduler.groups or self.scheduler.is_live(msg.request_id):
            raise ValueError(f"request_id {msg.request_id!r} is already in use")
        check_pooling_input(Limits(self.max_model_len, self.config.max_logprobs,
                                   self.model_config.vocab_size, self._context_note), prompt)
        blocks = self.kv.max_blocks_held(len(prompt), self.scheduler.config.max_num_batched_tokens)
        if blocks > self.num_gpu_blocks:
            raise ValueError(f"input needs {blocks} KV blocks; the pool has {self.num_gpu_blocks}")
        if s.pooling.dimensions is not None and not info.allows(s.pooling.dimensions):
            raise ValueError(f"dimensions {s.pooling.dimensions} is not one this model's "
                             f"{info.dimensions}-value embeddings can be truncated to")
        if info.num_labels is not None:
            prompt = self._cross_encoder_input(prompt, s.pooling)
        pooling = msgspec.structs.replace(
            s.pooling, method=s.pooling.method or info.method,
            normalize=info.normalize if s.pooling.normalize is None else s.pooling.normalize)
        s = msgspec.structs.replace(s, pooling=pooling)
        return Request(msg.request_id, list(prompt), s, 0, msg.priority,
                       msg.arrival_time or time.time())

    def _cross_encoder_input(self, prompt: Sequence[int], params: PoolingParams) -> Sequence[int]:
        """A cross-encoder's input up to its last token that is not the config's pad id (HF's
        rule for the token its score head reads; the first token if all are pads).
        NOTE: the tokens after it cannot change its state (causal attention), so they are not
        computed at all."""
        if params.method not in (None, "last") or params.dimensions is not None:
            raise ValueError("a cross-encoder pools the last token with its score head: no "
                             "pooling method or dimensions to choose")
        pad = self.model_config.pad_token_id
        end = len(prompt)
        while pad is not None and end > 1 and prompt[end - 1] == pad:
            end -= 1
        return prompt[:end]

    def _lora_id(self, name: str | None) -> int | None:
        if name is None:
            return None
        lora_id = None if self.lora is None else self.lora.id_of(name)
        if lora_id is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return lora_id

    def _num_blocks(self) -> int:
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        per_block = self.block_size * self.model_config.kv_bytes_per_token * self.kv_dtype.itemsize
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            budget *= 0.9  # NOTE: headroom for activations, which we do not profile yet
        else:
            budget = self.config.kv_cache_space * 2**30
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError("no memory left for the KV cache: raise the memory budget")
        return blocks


def _lora_slots(config: EngineConfig, model, dtype: torch.dtype,
                device: torch.device) -> LoraSlots | None:
    """The adapters' slots (the model's linears wrapped) and --lora-modules loaded, or None."""
    if not config.enable_lora:
        return None
    limits = LoraLimits(config.max_loras, config.max_lora_rank,
                        config.max_cpu_loras or config.max_loras)
    slots = LoraSlots(model, limits, dtype, device)
    for name, path in config.lora_paths.items():
        slots.add(name, path)
    return slots


def _lora_stats(lora: LoraSlots | None) -> dict[str, int]:
    if lora is None:
        return {}
    return {"lora_adapters": len(lora.paths), "lora_slots_total": lora.limits.max_loras,
            "lora_slots_used": lora.num_slots_used, "lora_cpu_bytes": lora.cpu_bytes}


def _lltokenizer(directory: str, vocab_size: int, eos_token_ids: list[int]):
    from engine.sched.structured.tokenizer import build_lltokenizer  # NOTE: llguidance, lazily

    return build_lltokenizer(directory, vocab_size, eos_token_ids)


def _spec_config(config: EngineConfig, num_layers: int) -> SpecConfig | None:
    if config.speculative_method is None:
        return None
    if config.speculative_method == "self" and config.speculative_draft_layers >= num_layers:
        raise ValueError(f"speculative_draft_layers must be < the model's {num_layers} layers")
    return SpecConfig(config.speculative_method, config.num_speculative_tokens,
                      config.prompt_lookup_max, config.prompt_lookup_min)


def _load_model(config: EngineConfig, source, dtype: torch.dtype, device: torch.device,
                quantization: str, numerics: str):
    """The model (rank 0's shard under tensor parallelism), its config, the other ranks."""
    if config.tensor_parallel_size == 1:
        return (*load_model(source, dtype, device, quantization, numerics,
                            config.packed_tile_cache), None)
    if not source.is_gguf and from_hf_config(source.path).num_labels is not None:
        raise ValueError("tensor_parallel_size: a cross-encoder (sequence classifier) is served "
                         "on one rank only")
    from engine.parallel.driver import launch  # NOTE: lazy: torch.distributed, spawns ranks

    return launch(config, source, dtype, device)


def _fit_context(max_model_len: int, num_blocks: int, block_size: int, full_blocks: int) -> int:
    """The context length one request can really use: at most what the KV pool holds
    (`full_blocks`: what a request of max_model_len tokens holds at its peak), lowered with a
    warning as vLLM does; ValueError if not even a tiny context fits."""
    pool_tokens = num_blocks * block_size
    if full_blocks <= num_blocks or pool_tokens >= max_model_len:
        return max_model_len
    if pool_tokens < min(_MIN_CONTEXT_TOKENS, max_model_len):
        raise ValueError(f"num_gpu_blocks: the KV pool ({num_blocks} blocks of {block_size} "
                         f"tokens) holds fewer than {_MIN_CONTEXT_TOKENS} tokens")
    log.warning("max_model_len lowered from %d to %d: what the KV pool (%d blocks of %d "
                "tokens) holds", max_model_len, pool_tokens, num_blocks, block_size)
    return pool_tokens


def _max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    model_max = model.max_position_embeddings
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        why = f" ({model.context_limit_reason})" if model.context_limit_reason else ""
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"{model_max} positions{why}")
    return config.max_model_len
