"""Tiny random-weight checkpoints of every supported family, built by transformers' own config
and model classes (2-3 layers, GQA, small windows) with the bundled tokenizer.

A plain module (not conftest), as tiny_llama.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

WINDOW = 24
ATTN_GAIN = 4.0  # smaller than the test prompts, not a multiple of the block size (16)

_COMMON: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

# name -> (transformers config class, model class, overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=WINDOW, original_max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(8)],
                      "long_factor": [4.0] * 8})),
}


def build_family(name: str, path: Path, tokenizer_dir: Path, seed: int = 0,
                 **extra: Any) -> Path:
    """Save family `name` (config fields changed by `extra`) as random-weight HF
    safetensors with the bundled tokenizer."""
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    config = getattr(transformers, config_cls)(**(_COMMON | overrides | extra))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    with torch.no_grad():  # larger logits spread: fewer near-ties in greedy parity checks
        model.get_input_embeddings().weight.normal_(0, 0.5)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias"):  # not the identity: used
                p.normal_(0, 0.3) if n.endswith("bias") else p.add_(torch.randn_like(p) * 0.2)
            if "self_attn" in n and not n.endswith("norm.weight"):
                p.mul_(ATTN_GAIN)  # sharp attention that carries far: windows matter
            if "post_attention_layernorm" in n and name.startswith("gemma"):
                p.add_(ATTN_GAIN)  # Gemma normalizes attention's output: weigh it up
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path
