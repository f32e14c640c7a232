"""Load a model (Llama layout or Gemma) from a local HF directory (safetensors) or a GGUF file."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.allocator import release_freed_heap
from engine.models.config import ModelConfig, from_hf_config, longrope_context
from engine.models.gemma import GemmaForCausalLM
from engine.models.gguf_file import GGMLType, GGUFTensor
from engine.models.llama import LlamaForCausalLM
from ipc.model_source import ModelSource

log = logging.getLogger(__name__)
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str = "none",
    numerics: str = "a32", tile_cache: bool = False,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """quantization: a concrete mode from `resolve_quantization` (none, gguf or int8);
    tile_cache: gguf's packed tiles mapped from, or saved to, the source's tiles file
    (engine/models/tile_store.py)."""
    if quantization == "gguf":
        return _gguf_quantized(source, dtype, device, numerics, tile_cache)
    if source.is_gguf:
        cfg, weights = _gguf_dequantized(source)
    else:
        cfg = from_hf_config(source.path)
        weights = _safetensors_weights(source.path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    _materialize(model, dtype, device)
    model.load_weights(weights)
    if quantization == "int8":
        from engine.models.quant_linear import quantize_dense_model

        quantize_dense_model(model, numerics)
    return model.eval().requires_grad_(False), cfg


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Uninitialized storage for a meta-device model's parameters and buffers (floats in
    `dtype`): what `model.to(dtype).to_empty(device)` does.
    NOTE: to_empty's empty_like goes through torch._refs, which imports sympy (20 MB
    resident in the engine); torch.empty does not."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = torch.empty(t.shape, device=device,
                                  dtype=dtype if t.is_floating_point() else t.dtype)
                table[name] = torch.nn.Parameter(new, t.requires_grad) if isinstance(
                    t, torch.nn.Parameter) else new


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder for the config: Gemma's layout, or Llama's (every other family)."""
    return GemmaForCausalLM if cfg.sandwich_norms else LlamaForCausalLM


def resolve_quantization(mode: str, source: ModelSource, dtype: torch.dtype,
                         device: torch.device, tensor_parallel_size: int = 1) -> str:
    """The concrete mode for `--quantization`: auto keeps a GGUF's blocks where the quantized
    kernels run (float32 on a CPU with the CPU library (kernels/cpu) built, one rank), else none."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}")
    if mode == "none":
        return mode
    if mode == "gguf" and not source.is_gguf:
        raise ValueError("quantization gguf needs a .gguf model (int8 quantizes a dense one)")
    if mode == "int8" and source.is_gguf:
        raise ValueError("quantization int8 is for dense checkpoints: a GGUF keeps its own "
                         "types with gguf (or auto)")
    from kernels.cpu import quant as cpu_quant

    why = None
    if device.type != "cpu" or dtype != torch.float32:
        why = "a float32 model on the CPU"
    elif tensor_parallel_size > 1:
        why = "tensor_parallel_size 1"
    elif not cpu_quant.available():
        why = "kernels/cpu (the C library), which could not be built (no C compiler?)"
    if mode == "auto":
        return "gguf" if source.is_gguf and why is None else "none"
    if why is not None:
        raise ValueError(f"quantization {mode} needs {why}")
    return mode


def _safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        yield from _safetensors_file(path)


# ---- GGUF --------------------------------------------------------------------------------


def _gguf_dequantized(source: ModelSource) -> tuple[ModelConfig, Iterator]:
    """Config and float32 HF-named weights of a GGUF, dequantized once and cached.

    NOTE: parsing a GGUF (its tokenizer arrays) and dequantizing take ~6 s on two cores; the
    cached safetensors file loads by mmap in well under a second.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    cache = float32_cache(source)
    if not cache.is_file():
        reader = _open_gguf(source.path)
        cfg = gguf_config(reader)
        tensors = dict(_gguf_weights(reader, cfg))
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp-{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"config": json.dumps(dataclasses.asdict(cfg))})
        os.replace(tmp, cache)
        return cfg, iter(tensors.items())
    with safe_open(str(cache), framework="pt") as f:
        raw = json.loads(f.metadata()["config"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    raw["layer_windows"] = tuple(raw["layer_windows"])  # JSON made the tuples lists
    return ModelConfig(**raw), _safetensors_file(cache)


def float32_cache(source: ModelSource) -> Path:
    """Where a GGUF's dequantized float32 weights are cached (tensor-parallel ranks read it).

    NOTE: v2: the config grew the model-family fields (windows, norms, soft-caps); a cache
    written by an older build lacks them, so it is not read."""
    return source.cache_dir() / "weights-float32-v2.safetensors"


def _gguf_quantized(source: ModelSource, dtype: torch.dtype, device: torch.device,
                    numerics: str, tile_cache: bool) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model with its GGUF's linear and embedding weights kept in their blocks; tensors of
    types without a kernel are dequantized (one log line each), norms are float32 already."""
    from engine.models.quant_linear import QuantWeight, install_quantized
    from engine.models.tile_store import TileStore, model_store
    from kernels.cpu import quant as cpu_quant

    reader = _open_gguf(source.path)
    cfg = gguf_config(reader)
    quant: dict[str, QuantWeight] = {}
    floats: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if _is_rope_factors(t.name):
            continue  # in the config (Phi-3's longrope, Llama 3's frequency factors)
        name = gguf_to_hf_name(t.name, cfg.architecture)
        rope_heads = _rope_heads(cfg, name)
        if int(t.tensor_type) in cpu_quant.BLOCKS and t.data.ndim == 2:
            type_id, cols = int(t.tensor_type), int(t.shape[0])
            if cpu_quant.packs(type_id, cols) and not rope_heads:
                # NOTE: packed straight from the file's pages (quant_linear packs them into
                # tiles), no copy of the raw blocks on the heap first: 96 MB on SmolLM2
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only, only read
                    blocks = torch.from_numpy(t.data)
            else:
                blocks = torch.from_numpy(np.array(t.data))  # NOTE: a copy: read-only memmap
            w = QuantWeight(blocks, type_id, blocks.shape[0], cols)
            if rope_heads:
                w = w.permute_rows(_rope_row_order(w.rows, rope_heads))
            quant[name] = w
            continue
        if t.tensor_type not in _FLOATS:
            log.info("%s: %s has no quantized kernel; dequantized to float32 at load",
                     t.name, t.tensor_type.name)
        tensor = torch.from_numpy(_dequantize(t)).float()
        if rope_heads:
            tensor = _unpermute_rope(tensor, rope_heads)
        if cfg.norm_offset and name.endswith("norm.weight"):
            tensor = tensor - cfg.norm_offset  # NOTE: as _gguf_weights: GGUF stores 1 + w
        floats[name] = tensor
        if tensor.dim() == 2:  # NOTE: a dense part of a layer whose other parts may be blocks
            quant[name] = QuantWeight(tensor, None, *tensor.shape)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    tiles = model_store(source.cache_dir()) if tile_cache else TileStore()
    used = install_quantized(model, quant, numerics, floats, tiles)
    tiles.save()
    _materialize(model, dtype, device)
    model.load_weights((n, t) for n, t in floats.items() if n not in used)
    del reader, quant, floats
    release_freed_heap()
    return model.eval().requires_grad_(False), cfg


def _rope_heads(cfg: ModelConfig, name: str) -> int:
    """Heads of a llama q/k projection whose rotary halves llama.cpp interleaved, else 0."""
    if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        return cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
    return 0


def _rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row i of the un-interleaved weight is row order[i] of the file's (_unpermute_rope)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _safetensors_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _open_gguf(path: Path):
    """engine/models/gguf_file.py's reader (the `gguf` package's takes 2-3 s on SmolLM2)."""
    from engine.models.gguf_file import GGUFFile

    return GGUFFile(path)


def _field(reader, key: str, default=None):
    return reader.fields.get(key, default)


# GGUF architecture -> our model_type (llama.cpp writes Gemma 3 text as gemma3)
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
               "gemma2": "gemma2", "gemma3": "gemma3_text"}


def gguf_config(reader) -> ModelConfig:
    """The config from a GGUF's metadata, with llama.cpp's meaning for each key (and its
    built-in values where the file has none: Gemma's layer patterns, Gemma 3's local base)."""
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{sorted(_GGUF_ARCHS)}")
    model_type = _GGUF_ARCHS[arch]

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    heads, hidden = key("attention.head_count"), key("embedding_length")
    layers = key("block_count")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    fields: dict = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(reader, arch),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        attention_bias="blk.0.attn_q.bias" in names,
        architecture=model_type,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    window = key("attention.sliding_window")
    if arch.startswith("gemma"):
        pattern = _gguf_window_pattern(key("attention.sliding_window_pattern"), arch)
        fields.update(
            hidden_act="gelu_tanh", norm_offset=1.0, sandwich_norms=True,
            embed_scale=math.sqrt(hidden), attn_scale=head_dim**-0.5,
            layer_windows=tuple(window if window and pattern(i) else None
                                for i in range(layers)))
        if arch == "gemma2":  # NOTE: HF's Gemma2Config defaults where the file has no key
            fields.update(attn_softcap=key("attn_logit_softcapping", 50.0),
                          final_softcap=key("final_logit_softcapping", 30.0))
        else:
            fields["local_rope_theta"] = key("rope.freq_base_swa", 10000.0)  # llama.cpp's
    elif window:
        fields["layer_windows"] = (window,) * layers
    if fields["rope_scaling"] and fields["rope_scaling"]["rope_type"] == "longrope":
        cfg = {"max_position_embeddings": fields["max_position_embeddings"]}
        fields.update(longrope_context(cfg, fields["rope_scaling"]))
    return ModelConfig(**fields)


def _gguf_window_pattern(value, arch: str):
    """Which layers are windowed: the file's per-layer flags or period, else llama.cpp's
    fixed rule (Gemma 2: every other layer from the first; Gemma 3: five in six)."""
    if isinstance(value, list):
        return lambda i: bool(value[i])
    period = int(value) if value else (2 if arch == "gemma2" else 6)
    if arch == "gemma2":
        return lambda i: i % period == 0
    return lambda i: (i + 1) % period != 0


def _is_rope_factors(name: str) -> bool:
    return name.startswith("rope_factors_") or name == "rope_freqs.weight"


def _gguf_rope_scaling(reader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        # NOTE: Llama 3.x: llama.cpp's converter bakes the llama3 scaling into one factor per
        # rotary pair (the pair's frequency is divided by it); the config keys are dropped
        return {"rope_type": "freq_factors", "factors": [float(x) for x in freqs.data]}
    short = next((t for t in reader.tensors if t.name == "rope_factors_short.weight"), None)
    if short is None:
        return None
    # Phi-3's longrope: llama.cpp keeps the factors as tensors
    long = next(t for t in reader.tensors if t.name == "rope_factors_long.weight")
    scaling = {"rope_type": "longrope", "short_factor": [float(x) for x in short.data],
               "long_factor": [float(x) for x in long.data],
               "original_max_position_embeddings": _field(
                   reader, f"{arch}.rope.scaling.original_context_length")}
    factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if factor is not None:
        scaling["attention_factor"] = factor
    return scaling


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# where an architecture's names mean something else
_GGUF_ARCH_NAMES = {
    "gemma": {"post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # llama.cpp keeps Phi-3's gate and up fused
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    m = _BLOCK.fullmatch(name)
    if m:
        layer, part, kind = m.groups()
        names = _GGUF_ARCH_NAMES.get("gemma" if arch.startswith("gemma") else arch, {})
        return f"model.layers.{layer}.{names.get(part) or _GGUF_NAMES[part]}.{kind}"
    base, kind = name.rsplit(".", 1)
    return f"{_GGUF_NAMES[base]}.{kind}"


_FLOATS = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def _dequantize(t: GGUFTensor) -> np.ndarray:
    """A tensor's values as a new float array (the file's view is read-only): numpy for the
    float types, the `gguf` package's dequantize (imported only then) for blocks."""
    if t.tensor_type in (GGMLType.F32, GGMLType.F16):
        return t.data.astype(np.float32)
    if t.tensor_type == GGMLType.BF16:  # NOTE: uint8 rows of bytes; a value is a float32's top half
        bits = t.data.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    from gguf.quants import dequantize

    return dequantize(t.data, t.tensor_type).copy()


def _gguf_weights(reader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for t in reader.tensors:
        if _is_rope_factors(t.name):
            continue  # in the config (Phi-3's longrope, Llama 3's frequency factors)
        tensor = torch.from_numpy(_dequantize(t)).float()
        name = gguf_to_hf_name(t.name, cfg.architecture)
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            tensor = _unpermute_rope(tensor, heads)
        if cfg.norm_offset and name.endswith("norm.weight"):
            # NOTE: llama.cpp stores Gemma's norms as 1 + w; load_weights adds the offset
            tensor = tensor - cfg.norm_offset
        yield name, tensor


def _unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    # NOTE: llama.cpp's converter interleaves each head's rotary halves; undo it so the
    # rotate-half RoPE of HF checkpoints applies.
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
