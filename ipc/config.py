"""Engine options as one frozen dataclass: the engine runs on it, the gateway forwards it.

It lives in ipc (stdlib only) because both processes need it: the gateway documents and passes
the flags when it spawns an engine, the engine builds its parts from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

_ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_CACHE_DTYPES = ("auto", "float32", "float16", "half", "fp8_e4m3")
_PREEMPTION_MODES = ("auto", "swap", "recompute")
_CPU_LINEARS = ("auto", "torch", "onednn", "dual")
_SPECULATIVE_METHODS = ("ngram", "self", "draft")
_QUANTIZATIONS = ("auto", "none", "gguf", "int8")
_QUANT_NUMERICS = ("auto", "a32", "a8")
POOLING_METHODS = ("last", "mean", "cls")  # embedding requests (ipc/pooling.py)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every engine option; each field is a CLI flag (`--max-num-seqs`) and an `LLM` keyword."""

    model: str | None = field(
        default=None,
        metadata={"help": "HF model directory or .gguf file, or gemma3-270m (the gemma3 extra) "
                          "(default: the bundled SmolLM2-135M)"},
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer directory (default: the model's own)"}
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name reported by the API (default: from the model)"}
    )
    dtype: str = field(
        default="auto", metadata={"help": "weights and activations; auto: float32 on CPU, "
                                          "bfloat16 on GPU", "choices": _DTYPES}
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length (default: the model's)"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    num_gpu_blocks: int | None = field(
        default=None, metadata={"help": "KV blocks in the pool (overrides the memory budget)"}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "fraction of GPU memory for weights, activations and KV"}
    )
    kv_cache_space: float = field(
        default=1.0, metadata={"help": "GiB of host memory for the KV pool on CPU"}
    )
    max_num_seqs: int = field(default=128, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "token budget of one engine step (chunked prefill); "
                                "default 512 on the CPU (llama.cpp's batch), 2048 on a GPU"}
    )
    max_prefill_tokens_while_decoding: int | None = field(
        default=None, metadata={"help": "most tokens of one prompt a step computes while other "
                                "requests decode (they wait for the step); default 128 on the "
                                "CPU, unlimited on a GPU; 0: unlimited (the step budget only)"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV blocks of shared prompt prefixes"}
    )
    batch_invariant: bool = field(
        default=True, metadata={"help": "a request's logits are the same bits whatever its "
                                "batch mates, prefill chunking and prefix-cache state: on the "
                                "CPU backend every prefill token attends as its decode would "
                                "(the decode kernel; long prompts prefill slower: see "
                                "bench/RESULTS.md); off: prefill attention in SDPA"}
    )
    enable_window_freeing: bool = field(
        default=True, metadata={"help": "release KV blocks older than the sliding window when "
                                        "every layer of the model is windowed"}
    )
    swap_space: float = field(
        default=4.0, metadata={"help": "GiB of host memory for swapping out preempted requests"}
    )
    preemption_mode: str = field(
        default="auto", metadata={"help": "auto: swap or recompute by estimated cost",
                                  "choices": _PREEMPTION_MODES}
    )
    attention_backend: str = field(
        default="auto", metadata={"help": "paged attention kernels", "choices": _ATTENTION_BACKENDS}
    )
    speculative_method: str | None = field(
        default=None, metadata={"help": "speculative decoding proposer: ngram (prompt lookup), "
                                        "self (the model's first layers as a draft) or draft "
                                        "(--speculative-model)",
                                "choices": _SPECULATIVE_METHODS}
    )
    num_speculative_tokens: int = field(
        default=5, metadata={"help": "tokens proposed per step (gamma; adapts down per request)"}
    )
    speculative_model: str | None = field(
        default=None, metadata={"help": "the draft model for --speculative-method draft: a "
                                        "smaller model (HF directory or .gguf) with the "
                                        "target's tokenizer"}
    )
    speculative_draft_layers: int = field(
        default=4, metadata={"help": "layers of the target that form the self draft"}
    )
    prompt_lookup_max: int = field(
        default=4, metadata={"help": "longest n-gram the ngram proposer matches"}
    )
    prompt_lookup_min: int = field(
        default=1, metadata={"help": "shortest n-gram the ngram proposer matches"}
    )
    kv_cache_dtype: str = field(
        default="auto", metadata={"help": "KV cache storage; auto: float16 beside a8 "
                                          "numerics, else the model dtype; float32 (a float32 "
                                          "model's); float16 (or half): 16 bits, widened to the "
                                          "model dtype on read (llama.cpp's default; half a "
                                          "float32 cache); "
                                          "fp8_e4m3: 8 bits, upcast on read, scaled by the "
                                          "checkpoint's k/v scales (per tensor or per head) if "
                                          "it has them",
                                  "choices": _KV_CACHE_DTYPES}
    )
    seed: int = field(default=0, metadata={"help": "seed for requests that set none"})
    max_logprobs: int = field(default=20, metadata={"help": "most top logprobs a request may ask"})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (default: torch's choice)"}
    )
    cpu_linear: str = field(
        default="auto", metadata={"help": "CPU float32 matmuls: torch (checkpoint layout), onednn "
                                          "(weights prepacked once), dual (both, picked by row "
                                          "count; weights twice); auto: dual if it fits",
                                  "choices": _CPU_LINEARS}
    )
    structured_output_compile_timeout: float = field(
        default=5.0, metadata={"help": "seconds a grammar (response_format, tools, "
                               "structured_outputs) may take to compile before its request "
                               "fails with a 400"}
    )
    structured_output_close_on_budget: bool = field(
        default=True, metadata={"help": "a reply with a grammar (JSON, tool calls) keeps room "
                                "in max_tokens for the tokens that close it, so it ends "
                                "valid whenever a closing fits"}
    )
    quantization: str = field(
        default="auto", metadata={"help": "weights kept quantized on the CPU: gguf (a GGUF's "
                                          "own blocks), int8 (a dense checkpoint quantized at "
                                          "load to Q8_0 blocks), none (dequantized to the model "
                                          "dtype); auto: gguf for a GGUF where it runs, else none",
                                  "choices": _QUANTIZATIONS}
    )
    packed_tile_cache: bool = field(
        default=True, metadata={"help": "keep a quantized GGUF's packed tiles in a file beside "
                                "its other derived files ($PAGEDSERVE_CACHE, else "
                                "~/.cache/pagedserve; a second copy of its quantized "
                                "weights), so that later starts map them instead of packing "
                                "them again"}
    )
    quantization_numerics: str = field(
        default="auto", metadata={"help": "quantized products: a32 (weights expanded to "
                                          "float32, float32 FMA: the dequantized model's "
                                          "result, HF's tokens) or a8 (activations to int8 per "
                                          "32 values, integer dot products, prefill chunks "
                                          "included: llama.cpp's); auto: a8 for a GGUF kept "
                                          "quantized (with a float16 KV cache), else a32",
                                 "choices": _QUANT_NUMERICS}
    )
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "ranks the model is split across, one process each "
                                     "(NCCL on GPUs, gloo on CPU), over all nodes"}
    )
    nnodes: int = field(
        default=1, metadata={"help": "nodes the tensor-parallel ranks span (each runs "
                                     "tensor_parallel_size / nnodes of them); node 0 runs "
                                     "`serve`, the others `serve --headless`"}
    )
    node_rank: int = field(
        default=0, metadata={"help": "this node's index in [0, nnodes); node 0 holds rank 0 "
                                     "and the scheduler"}
    )
    master_addr: str = field(
        default="127.0.0.1", metadata={"help": "address of node 0, where every rank meets "
                                               "(torch.distributed rendezvous)"}
    )
    master_port: int | None = field(
        default=None, metadata={"help": "TCP port of that rendezvous on node 0; needed when "
                                        "nnodes > 1 (default: a free port, single node)"}
    )
    pooling: str | None = field(
        default=None, metadata={"help": "how embedding requests pool the prompt's hidden "
                                        "states: last (token), mean or cls (first token); "
                                        "default: the checkpoint's sentence-transformers "
                                        "config, else last", "choices": POOLING_METHODS}
    )
    # ---- LoRA adapters (vLLM's flags; engine/run/lora) ----
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters per "
                                                               "request (chosen by `model`)"})
    lora_modules: tuple[str, ...] = field(
        default=(), metadata={"help": "adapters loaded at start, as name=path (a PEFT "
                                      "directory) ...; `serve` also takes vLLM's JSON "
                                      "'{\"name\": ..., \"path\": ..., \"base_model_name\": "
                                      "...}', which several models need (default: none)",
                              "nargs": "+"}
    )
    max_loras: int = field(default=1, metadata={"help": "adapters in one step (device slots)"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest adapter rank accepted"})
    max_cpu_loras: int | None = field(
        default=None, metadata={"help": "adapters kept read in host memory, the rest are read "
                                        "again from disk (default: max_loras)"}
    )

    def __post_init__(self) -> None:
        if self.pooling not in (None, *POOLING_METHODS):
            raise ValueError(f"pooling must be one of {POOLING_METHODS}")
        if self.speculative_method not in (None, *_SPECULATIVE_METHODS):
            raise ValueError(f"speculative_method must be one of {_SPECULATIVE_METHODS}")
        _positive(self, "num_speculative_tokens", "speculative_draft_layers",
                  "prompt_lookup_max", "prompt_lookup_min")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model is needed by, and only by, "
                             "speculative_method draft")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        _positive(self, "block_size", "max_num_seqs",
                  "tensor_parallel_size", "nnodes")
        self._check_nodes()
        _positive_or_none(self, "num_gpu_blocks", "max_model_len", "num_threads",
                          "max_num_batched_tokens")
        if (self.max_prefill_tokens_while_decoding or 0) < 0:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_space <= 0:
            raise ValueError("kv_cache_space must be > 0")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}")
        if self.cpu_linear not in _CPU_LINEARS:
            raise ValueError(f"cpu_linear must be one of {_CPU_LINEARS}")
        if self.tensor_parallel_size > 1 and self.cpu_linear in ("onednn", "dual"):
            raise ValueError(f"cpu_linear {self.cpu_linear} does not run with tensor "
                             "parallelism (its ranks use torch's products): use auto or torch")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}")
        if self.quantization_numerics not in _QUANT_NUMERICS:
            raise ValueError(f"quantization_numerics must be one of {_QUANT_NUMERICS}")
        if self.tensor_parallel_size > 1 and self.speculative_method == "draft":
            raise ValueError("speculative_method draft does not run with tensor parallelism "
                             "(the draft model would have no shards): use ngram or self")
        if self.tensor_parallel_size > 1 and self.quantization in ("gguf", "int8"):
            raise ValueError(f"quantization {self.quantization} does not run with tensor "
                             "parallelism (its ranks hold dequantized weights): use none or auto")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
        if not self.structured_output_compile_timeout > 0:
            raise ValueError("structured_output_compile_timeout must be > 0")
        if self.swap_space < 0:
            raise ValueError("swap_space must be >= 0")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {_PREEMPTION_MODES}")
        self._check_lora()

    def _check_lora(self) -> None:
        _positive(self, "max_loras", "max_lora_rank")
        _positive_or_none(self, "max_cpu_loras")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        for entry in self.lora_modules:
            name, _, path = entry.partition("=")
            if not name or not path:
                raise ValueError(f"lora_modules: {entry!r} is not name=path")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not run with tensor parallelism yet")
        if self.enable_lora and self.speculative_method is not None:
            raise ValueError("enable_lora does not run with speculative decoding yet (the "
                             "draft would propose without the adapter)")

    @property
    def lora_paths(self) -> dict[str, str]:
        """lora_modules as name -> path."""
        return dict(entry.partition("=")[::2] for entry in self.lora_modules)

    def _check_nodes(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes) = [0, {self.nnodes})")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a "
                             f"multiple of nnodes ({self.nnodes}): each node runs as many ranks")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port is needed when nnodes > 1 (every node must name the "
                             "same rendezvous)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError("master_port must be in [1, 65535]")
        if not self.master_addr:
            raise ValueError("master_addr must not be empty")

    def check_headless(self) -> None:
        """A headless node (no gateway, no scheduler) is one of nodes 1..nnodes-1."""
        if self.node_rank == 0:
            raise ValueError("node_rank: a headless node is one of nodes 1..nnodes-1; node 0 "
                             "runs the engine (`pagedserve serve` or `pagedserve engine`)")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def to_cli_args(self) -> list[str]:
        """Flags that rebuild this config in another process (only non-defaults)."""
        args: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                args.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
            elif isinstance(value, tuple):
                args += [_flag(f.name), *value]
            else:
                args += [_flag(f.name), str(value)]
        return args


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field, with its default and help text."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        help_text = f.metadata.get("help", "")
        # NOTE: some helps say their default in words; a None default's help says what then
        if "default" not in help_text.lower() and f.default is not None:
            help_text += f" (default: {f.default})"
        if f.type == "bool":
            group.add_argument(_flag(f.name), dest=f.name, default=f.default, help=help_text,
                               action=argparse.BooleanOptionalAction)
            continue
        if "nargs" in f.metadata:  # NOTE: a tuple of strings: `--lora-modules a=x b=y`
            group.add_argument(_flag(f.name), dest=f.name, default=f.default, help=help_text,
                               nargs=f.metadata["nargs"])
            continue
        kind = _base_type(f.type)
        group.add_argument(
            _flag(f.name), dest=f.name, type=kind, default=f.default,
            choices=f.metadata.get("choices"), help=help_text,
        )


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(ns, f.name) for f in fields(EngineConfig)}
    return EngineConfig(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in values.items()})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: object) -> type:
    text = str(annotation)
    for kind in (int, float, str):
        if text.startswith(kind.__name__):
            return kind
    raise TypeError(f"unsupported config field type {annotation}")


# NOTE: on the CPU, 512-token prefill chunks (llama.cpp's default batch) against 2048: engine
# RSS peak 560-569 against 648-673 MiB on the bundled model (bench/RESULTS.md), and in process
# 64 streams of 128 + 128 tokens at 650-659 against 618-619 tok/s (a8), 348 against 328
# (float32), 340 against 358 (a32, one run each).
STEP_TOKENS = {"cpu": 512}
DEFAULT_STEP_TOKENS = 2048


# NOTE: python -m bench.long_prefill, bundled model, AVX2-only 2-core EPYC: 8 streams decoding
# while a 4096-token prompt arrives: their ITL p99 while it prefills is 2744 ms with its
# chunks at the 512-token budget (50 ms alone), 1173 ms at 128 and 680 ms at 64, its first
# token 16.2, 21.4 and 29.6 s; a prompt with nothing decoding beside it keeps the whole
# budget (bench/RESULTS.md).
PREFILL_WHILE_DECODING = {"cpu": 128}


def prefill_tokens_while_decoding(cfg: EngineConfig, device_type: str) -> int | None:
    """max_prefill_tokens_while_decoding resolved: its default for the device; None: no cap."""
    value = cfg.max_prefill_tokens_while_decoding
    if value is None:
        return PREFILL_WHILE_DECODING.get(device_type)
    return value or None


def step_token_budget(cfg: EngineConfig, device_type: str) -> int:
    """max_num_batched_tokens, or its default for the device the engine runs on."""
    if cfg.max_num_batched_tokens is not None:
        return cfg.max_num_batched_tokens
    return STEP_TOKENS.get(device_type, DEFAULT_STEP_TOKENS)


def _positive(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1")


def _positive_or_none(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1")
