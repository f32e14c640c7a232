"""What an engine is made of, built in stages: the numerics (every auto resolved), the attention
backend (refused before anything loads), the model and its draft (loaded, then their fast paths
installed), the KV pool's size, the scheduler and the runner (rank 0's under tensor parallelism).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.allocator import tune_malloc
from engine.devices import resolve_device, resolve_dtype
from engine.models.accelerate import accelerate
from engine.models.config import ModelConfig, from_hf_config
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, resolve_quantization
from engine.models.numerics import resolve_kv_dtype, resolve_numerics
from engine.models.pooling_config import pooling_info
from engine.models.quant_linear import count_weights
from engine.run.lora.slots import LoraLimits, LoraSlots
from engine.run.runner import ModelRunner
from engine.run.sampler import Sampler
from engine.sched.kv_manager import KVCacheManager
from engine.sched.preemption import PreemptionCost
from engine.sched.scheduler import Scheduler, SchedulerConfig, SpecConfig
from engine.sched.structured.compiler import GrammarCompiler
from engine.tokenizer import tokenizer_dir
from ipc.config import EngineConfig, prefill_tokens_while_decoding, step_token_budget
from ipc.model_source import ModelSource, resolve_model
from ipc.pooling import PoolingInfo
from kernels import Backend, auto_backend, get_backend

if TYPE_CHECKING:
    from engine.parallel.driver import Ranks, TensorParallelRunner

# NOTE: a pool smaller than this cannot hold a useful request: refuse to start.
_MIN_CONTEXT_TOKENS = 16

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    """Everything EngineCore runs with, every auto resolved."""

    device: torch.device
    dtype: torch.dtype  # the model's
    quantization: str  # the concrete mode (engine/models/loader.py)
    numerics: str  # of the quantized products (engine/models/numerics.py)
    kv_dtype: torch.dtype
    attention_backend: str  # the backend's name
    model_name: str
    tokenizer_dir: str
    model_config: ModelConfig
    eos_token_ids: list[int]
    pooling_info: PoolingInfo
    num_params: int  # counted before packing
    cpu_linear: str  # the target's linear mode (engine/models/accelerate.py)
    max_model_len: int  # the model's, or lower: what the KV pool holds
    context_note: str  # said in errors when max_model_len was lowered to the pool ("": not)
    num_gpu_blocks: int
    num_cpu_blocks: int  # the swap pool (0: none)
    block_bytes: int  # one block's K and V over every layer
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner | TensorParallelRunner
    lora: LoraSlots | None  # the adapters' slots (None: LoRA off)
    grammars: GrammarCompiler


@dataclass(frozen=True)
class _Numerics:
    quantization: str
    numerics: str
    kv_dtype: torch.dtype


@dataclass(frozen=True)
class _Target:
    """The target model (rank 0's shard under tensor parallelism), the other ranks, and what
    is read off the model: names, config, context length, pooling, weight count."""

    model: LlamaForCausalLM
    ranks: Ranks | None
    name: str
    tokenizer_dir: str
    config: ModelConfig
    max_model_len: int
    pooling_info: PoolingInfo
    eos_token_ids: list[int]
    num_params: int


@dataclass(frozen=True)
class _Pool:
    kv: KVCacheManager
    num_cpu_blocks: int
    max_model_len: int  # the context one request can really use
    context_note: str


def build(config: EngineConfig) -> EngineParts:
    """The engine's parts, in stages (each stage's inputs are the earlier stages' outputs)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source = resolve_model(config.model, config.served_model_name)
    nums = _numerics(config, source, dtype, device)
    backend_name = _attention_backend(config, device, nums.kv_dtype == dtype)
    backend = get_backend(backend_name, device.type)
    target = _target(config, source, dtype, device, nums)
    block_bytes = config.block_size * target.config.kv_bytes_per_token * nums.kv_dtype.itemsize
    # NOTE: from the memory the target model leaves (on CUDA), before the draft loads
    num_gpu_blocks = _num_blocks(config, block_bytes, device)
    draft = _draft_model(config, dtype, device, target.config.vocab_size)
    cpu_linear = _accelerate(config, backend, target.model, draft, device, dtype)
    step_tokens = step_token_budget(config, device.type)
    pool = _size_kv(config, target, draft, num_gpu_blocks, block_bytes, step_tokens)
    scheduler = _scheduler(config, target, pool, block_bytes, step_tokens, device)
    # NOTE: after packing and the fused paths: the adapters wrap whatever linears run
    lora = _lora_slots(config, target.model, dtype, device)
    runner = ModelRunner(
        target.model, num_gpu_blocks, config.block_size, pool.max_model_len,
        Sampler(config.seed, device), backend, device, nums.kv_dtype, pool.num_cpu_blocks,
        draft_layers=config.speculative_draft_layers, draft_model=draft,
        lora=lora, batch_invariant=config.batch_invariant,
    )
    if target.ranks is not None:
        runner = _tensor_parallel(config, runner, target.ranks, backend_name, nums.kv_dtype,
                                  num_gpu_blocks, pool)
    if device.type == "cpu":
        tune_malloc()  # NOTE: after loading and packing (engine/allocator.py says why)
    directory, vocab, eos = target.tokenizer_dir, target.config.vocab_size, target.eos_token_ids
    grammars = GrammarCompiler(
        lambda: _lltokenizer(directory, vocab, eos),
        config.structured_output_compile_timeout,
        close_on_budget=config.structured_output_close_on_budget)
    return EngineParts(
        device=device, dtype=dtype, quantization=nums.quantization, numerics=nums.numerics,
        kv_dtype=nums.kv_dtype, attention_backend=backend_name, model_name=target.name,
        tokenizer_dir=directory, model_config=target.config, eos_token_ids=eos,
        pooling_info=target.pooling_info, num_params=target.num_params, cpu_linear=cpu_linear,
        max_model_len=pool.max_model_len, context_note=pool.context_note,
        num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=pool.num_cpu_blocks,
        block_bytes=block_bytes, kv=pool.kv, scheduler=scheduler, runner=runner, lora=lora,
        grammars=grammars)


def _numerics(config: EngineConfig, source: ModelSource, dtype: torch.dtype,
              device: torch.device) -> _Numerics:
    """The concrete quantization, numerics and KV dtype (every auto resolved:
    engine/models/numerics.py), logged."""
    quantization = resolve_quantization(config.quantization, source, dtype, device,
                                        config.tensor_parallel_size)
    numerics = resolve_numerics(config.quantization_numerics, quantization)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, numerics, dtype)
    log.info("numerics: quantization %s, products %s, KV cache %s", quantization,
             numerics if quantization != "none" else "dense",
             str(kv_dtype).removeprefix("torch."))
    return _Numerics(quantization, numerics, kv_dtype)


def _attention_backend(config: EngineConfig, device: torch.device, cache_like_model: bool) -> str:
    """The backend that runs (auto resolved here), checked before any model loads."""
    name = (auto_backend(device.type, cache_like_model) if config.attention_backend == "auto"
            else config.attention_backend)
    if name == "flash_attn" and not cache_like_model:
        # NOTE: asked for by name (auto skips it): at start, not at the first request
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype}: the flash_attn backend "
                         "reads a KV cache of the model's dtype only (use "
                         "--attention-backend triton)")
    return name


def _target(config: EngineConfig, source: ModelSource, dtype: torch.dtype,
            device: torch.device, nums: _Numerics) -> _Target:
    name, tokenizer = source.name, str(tokenizer_dir(source, config.tokenizer))
    model, model_config, ranks = _load_model(config, source, dtype, device, nums.quantization,
                                             nums.numerics)
    max_model_len = _max_model_len(config, model_config)
    info = pooling_info(None if source.is_gguf else source.path, model_config.hidden_size,
                        config.pooling, model_config.num_labels)
    # NOTE: counted before packing: packed (and quantized) weights are not Parameters
    return _Target(model, ranks, name, tokenizer, model_config, max_model_len, info,
                   list(model_config.eos_token_ids), count_weights(model))


def _num_blocks(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
        budget *= 0.9  # NOTE: headroom for activations, which we do not profile yet
    else:
        budget = config.kv_cache_space * 2**30
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise ValueError("no memory left for the KV cache: raise the memory budget")
    return blocks


def _draft_model(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 vocab_size: int) -> LlamaForCausalLM | None:
    """The separate draft model of --speculative-method draft (it shares the tokenizer)."""
    if config.speculative_method != "draft":
        return None
    source = resolve_model(config.speculative_model)
    mode = resolve_quantization(config.quantization, source, dtype, device)
    draft, cfg = load_model(source, dtype, device, mode,
                            resolve_numerics(config.quantization_numerics, mode),
                            config.packed_tile_cache)
    if cfg.vocab_size != vocab_size:
        raise ValueError(
            f"the speculative model's vocabulary ({cfg.vocab_size}) differs from the "
            f"target's ({vocab_size}): it must share the tokenizer")
    return draft


def _accelerate(config: EngineConfig, backend: Backend, model: LlamaForCausalLM,
                draft: LlamaForCausalLM | None, device: torch.device, dtype: torch.dtype) -> str:
    """Every CPU fast path in the draft model, then the target (engine/models/
    accelerate.py); returns the target's linear mode."""
    if config.tensor_parallel_size > 1:
        return "torch"  # NOTE: the ranks hold the weights (EngineConfig refuses others)
    options = {"cpu_linear": config.cpu_linear, "fused_cpu_ops": backend.FUSED_CPU_OPS,
               "device": device, "dtype": dtype}
    if draft is not None:
        # NOTE: first, as ever: the target's auto mode sees the memory the draft's took
        accelerate(draft, **options)
    return accelerate(model, **options).cpu_linear


def _size_kv(config: EngineConfig, target: _Target, draft: LlamaForCausalLM | None,
             num_gpu_blocks: int, block_bytes: int, step_tokens: int) -> _Pool:
    """The swap pool, the KV manager, and the context one request can really use."""
    num_cpu_blocks = int(config.swap_space * 2**30 // block_bytes)
    kv = KVCacheManager(num_gpu_blocks, config.block_size, config.enable_prefix_caching,
                        num_cpu_blocks, _kv_window(config, target.config, draft))
    model_len = target.max_model_len
    # NOTE: with window freeing a request holds at most its window's blocks, whatever its
    # length; otherwise one block per block_size tokens
    full = kv.max_blocks_held(model_len, step_tokens)
    max_model_len = _fit_context(model_len, num_gpu_blocks, config.block_size, full)
    # NOTE: said in errors, so that a client knows why its context is short
    note = "" if max_model_len == model_len else f" (what {num_gpu_blocks} KV blocks hold)"
    return _Pool(kv, num_cpu_blocks, max_model_len, note)


def _kv_window(config: EngineConfig, model_config: ModelConfig,
               draft: LlamaForCausalLM | None) -> int | None:
    """The window behind which KV blocks are released: every layer's of the model (and of
    a separate draft model, which shares the block tables) when all have one."""
    window = model_config.kv_window if config.enable_window_freeing else None
    if window is not None and draft is not None:
        other = draft.cfg.kv_window
        window = None if other is None else max(window, other)
    return window


def _scheduler(config: EngineConfig, target: _Target, pool: _Pool, block_bytes: int,
               step_tokens: int, device: torch.device) -> Scheduler:
    preemption = PreemptionCost(block_bytes, 2.0 * target.num_params, device.type,
                                config.preemption_mode)
    return Scheduler(
        SchedulerConfig(config.max_num_seqs, step_tokens, pool.max_model_len,
                        _spec_config(config, target.config.num_layers),
                        target.config.vocab_size,
                        config.max_loras if config.enable_lora else None,
                        prefill_tokens_while_decoding(config, device.type)),
        pool.kv,
        target.eos_token_ids,
        preemption,
    )


def _spec_config(config: EngineConfig, num_layers: int) -> SpecConfig | None:
    if config.speculative_method is None:
        return None
    if config.speculative_method == "self" and config.speculative_draft_layers >= num_layers:
        raise ValueError(f"speculative_draft_layers must be < the model's {num_layers} layers")
    return SpecConfig(config.speculative_method, config.num_speculative_tokens,
                      config.prompt_lookup_max, config.prompt_lookup_min)


def _tensor_parallel(config: EngineConfig, runner: ModelRunner, ranks: Ranks,
                     backend_name: str, kv_dtype: torch.dtype, num_gpu_blocks: int,
                     pool: _Pool) -> TensorParallelRunner:
    """Rank 0's runner, with the other ranks' runners built alike (same sizes, seed)."""
    from engine.parallel.driver import TensorParallelRunner
    from engine.parallel.records import RunnerInit

    init = RunnerInit(num_gpu_blocks, config.block_size, pool.max_model_len, backend_name,
                      str(kv_dtype).removeprefix("torch."), pool.num_cpu_blocks,
                      config.speculative_draft_layers, config.seed, config.batch_invariant)
    return TensorParallelRunner(runner, ranks, init)


def _lora_slots(config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype,
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


def _lltokenizer(directory: str, vocab_size: int, eos_token_ids: list[int]):
    from engine.sched.structured.tokenizer import build_lltokenizer  # NOTE: llguidance, lazily

    return build_lltokenizer(directory, vocab_size, eos_token_ids)


def _load_model(config: EngineConfig, source: ModelSource, dtype: torch.dtype,
                device: torch.device, quantization: str, numerics: str):
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
