"""Load a Llama-family model from a local HF directory (safetensors) or a GGUF file."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.models.config import ModelConfig, from_hf_config
from engine.models.llama import LlamaForCausalLM
from ipc.model_source import ModelSource

log = logging.getLogger(__name__)
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str = "none",
    numerics: str = "a32",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """quantization: a concrete mode from `resolve_quantization` (none, gguf or int8)."""
    if quantization == "gguf":
        return _gguf_quantized(source, dtype, device, numerics)
    if source.is_gguf:
        cfg, weights = _gguf_dequantized(source)
    else:
        cfg = from_hf_config(source.path)
        weights = _safetensors_weights(source.path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(weights)
    if quantization == "int8":
        from engine.models.quant_linear import quantize_dense_model

        quantize_dense_model(model, numerics)
    return model.eval().requires_grad_(False), cfg


def resolve_quantization(mode: str, source: ModelSource, dtype: torch.dtype,
                         device: torch.device, tensor_parallel_size: int = 1) -> str:
    """The concrete mode for `--quantization`: auto keeps a GGUF's blocks where the quantized
    kernels run (float32 on a CPU with kernels/cpu_quant.c built, one rank), else none."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}")
    if mode == "none":
        return mode
    if mode == "gguf" and not source.is_gguf:
        raise ValueError("quantization gguf needs a .gguf model (int8 quantizes a dense one)")
    if mode == "int8" and source.is_gguf:
        raise ValueError("quantization int8 is for dense checkpoints: a GGUF keeps its own "
                         "types with gguf (or auto)")
    from kernels import cpu_quant

    why = None
    if device.type != "cpu" or dtype != torch.float32:
        why = "a float32 model on the CPU"
    elif tensor_parallel_size > 1:
        why = "tensor_parallel_size 1"
    elif not cpu_quant.available():
        why = "kernels/cpu_quant.c, which could not be built (no C compiler?)"
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

    cache = source.cache_dir() / "weights-float32.safetensors"
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
    return ModelConfig(**raw), _safetensors_file(cache)


def _gguf_quantized(source: ModelSource, dtype: torch.dtype, device: torch.device,
                    numerics: str) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model with its GGUF's linear and embedding weights kept in their blocks; tensors of
    types without a kernel are dequantized (one log line each), norms are float32 already."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from engine.models.quant_linear import QuantWeight, install_quantized
    from kernels import cpu_quant

    reader = _open_gguf(source.path)
    cfg = gguf_config(reader)
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    quant: dict[str, QuantWeight] = {}
    floats: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        rope_heads = _rope_heads(cfg, name)
        if int(t.tensor_type) in cpu_quant.BLOCKS and t.data.ndim == 2:
            blocks = torch.from_numpy(np.array(t.data))  # NOTE: a copy: the memmap is read-only
            w = QuantWeight(blocks, int(t.tensor_type), blocks.shape[0], int(t.shape[0]))
            if rope_heads:
                w = w.permute_rows(_rope_row_order(w.rows, rope_heads))
            quant[name] = w
            continue
        if t.tensor_type not in plain:
            log.info("%s: %s has no quantized kernel; dequantized to float32 at load",
                     t.name, t.tensor_type.name)
        tensor = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if rope_heads:
            tensor = _unpermute_rope(tensor, rope_heads)
        floats[name] = tensor
        if tensor.dim() == 2:  # NOTE: a dense part of a layer whose other parts may be blocks
            quant[name] = QuantWeight(tensor, None, *tensor.shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    used = install_quantized(model, quant, numerics, floats)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights((n, t) for n, t in floats.items() if n not in used)
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
    import gguf

    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (Llama family only)")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=_field(reader, f"{arch}.rope.dimension_count", hidden // heads),
        rms_norm_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_field(reader, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        attention_bias="blk.0.attn_q.bias" in names,
        architecture=arch,
    )


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str) -> str:
    m = _BLOCK.fullmatch(name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_GGUF_NAMES[part]}.{kind}"
    base, kind = name.rsplit(".", 1)
    return f"{_GGUF_NAMES[base]}.{kind}"


def _gguf_weights(reader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type)
        tensor = torch.from_numpy(array.copy()).float()
        name = gguf_to_hf_name(t.name)
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            tensor = _unpermute_rope(tensor, heads)
        yield name, tensor


def _unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    # NOTE: llama.cpp's converter interleaves each head's rotary halves; undo it so the
    # rotate-half RoPE of HF checkpoints applies.
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
