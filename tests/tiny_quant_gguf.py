"""Tiny GGUF files of one block type, written with the `gguf` package's GGUFWriter.

From a tiny HF Llama (tests/tiny_llama.py): the linear weights quantized to `type_name` by the
`gguf` package's own quantizer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), or, for the K-quants, which the
package cannot quantize, random blocks of that type with small finite scales (the model is
random either way). q/k rows are interleaved the way llama.cpp's converter does, so the loader's
un-interleaving is exercised. The embedding (and tied head) is Q8_0, norms F32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_FP16_AT = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82]}


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved rows (the converter's permute)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    b = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for off in _FP16_AT[type_name]:
        d = rng.uniform(0.0005, 0.003, size=b.shape[:2]).astype(np.float16)
        b[..., off:off + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(rows, -1)


def write_tiny_gguf(hf_dir: Path, path: Path, type_name: str, seed: int = 0,
                    overrides: dict[str, str] | None = None) -> Path:
    """overrides: GGUF tensor part (e.g. "attn_v") -> its own type (F16, Q2_K, ...)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    from engine.models.config import from_hf_config

    c = from_hf_config(hf_dir)
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    heads, kv = c.num_heads, c.num_kv_heads
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(c.eos_token_ids[0])
    w.add_bos_token_id(c.bos_token_id)
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        part = rest.removesuffix(".weight")
        gname = f"blk.{layer}.{_NAMES[part]}.weight"
        if t.ndim == 1:
            w.add_tensor(gname, t)
            continue
        if part in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _interleave(t, heads if part.endswith("q_proj") else kv)
        kind = (overrides or {}).get(_NAMES[part], type_name)
        if kind == "F16":
            w.add_tensor(gname, t.astype(np.float16))
            continue
        if kind in _FP16_AT:
            blocks = _random_k_blocks(kind, *t.shape, rng)
        else:
            blocks = quantize(t, gguf.GGMLQuantizationType[kind])
        w.add_tensor(gname, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
