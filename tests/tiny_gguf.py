"""Write a tiny HF checkpoint (tests/tiny_families.py) as a GGUF file with the `gguf` package's
writer, under its family's llama.cpp architecture, tensor names and metadata keys (F32/F16, or
the matrices in a block type the `gguf` package quantizes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

A plain module (not conftest), as tiny_llama.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# family -> GGUF architecture (llama.cpp's converter names)
ARCHS = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
         "gemma3": "gemma3", "phi3": "phi3"}
_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GEMMA = {"post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(model_dir: Path, out: Path, arch: str, dtype: str = "float32",
               rope_freqs: bool = True, overrides: dict[str, str] | None = None) -> Path:
    """The checkpoint in model_dir as GGUF `arch`; dtype float16 stores the matrices in F16, a
    block type name quantizes them to it (the embedding to Q8_0, as llama-quantize leaves it
    on small models), overrides: a block's tensor part (e.g. "attn_v") -> its own type;
    rope_freqs False leaves out Llama 3's frequency factors (a file that lost its scaling)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, cfg, arch)
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name, t in tensors.items():
        a = t.float().numpy()
        gname = _name(name, arch)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in gname else cfg["num_key_value_heads"]
            a = _permute(a, heads)  # llama.cpp's converter interleaves the rotary halves
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            a = a + 1  # llama.cpp stores Gemma's (1 + w)
        if dtype == "float16" and a.ndim == 2 and "embd" not in gname:
            a = a.astype(np.float16)
        elif dtype not in ("float32", "float16") and a.ndim == 2:
            kind = "Q8_0" if "embd" in gname else (overrides or {}).get(
                gname.split(".")[2], dtype)
            kind = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gname, quantize(a, kind), raw_dtype=kind)
            continue
        writer.add_tensor(gname, np.ascontiguousarray(a))
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    if rope.get("rope_type") == "llama3" and rope_freqs:
        writer.add_tensor("rope_freqs.weight", llama3_factors(cfg, rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _name(name: str, arch: str) -> str:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "token_embd.weight"
    if name == "norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, layer, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    table = (_GEMMA | _BLOCK) if arch.startswith("gemma") else (
        _BLOCK | {"post_attention_layernorm": "ffn_norm"})
    return f"blk.{layer}.{table[part]}.{kind}"


def _metadata(w, cfg: dict, arch: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf_scaling("linear"))
        w.add_rope_scaling_factor(full["factor"])
    if full.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if "layer_types" in cfg and arch.startswith("gemma"):
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def llama3_factors(cfg: dict, rope: dict) -> np.ndarray:
    """What llama.cpp's converter writes for llama3 scaling (LlamaModel.generate_extra_tensors):
    one factor per rotary pair, by which llama.cpp divides the pair's frequency."""
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / rope.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2) / dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def gguf_scaling(kind: str):
    import gguf

    return {"linear": gguf.RopeScalingType.LINEAR}[kind]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
