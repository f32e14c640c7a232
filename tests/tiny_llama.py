"""Tiny random-weight Llama checkpoints with the bundled tokenizer, for fast engine tests.

A plain module (not conftest) so that tests and helper scripts import it by name: inside pytest
`conftest` may name another directory's conftest module.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def build_tiny_llama(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight Llama (HF safetensors) with the bundled tokenizer into `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    with torch.no_grad():  # larger logits spread: fewer near-ties in greedy parity checks
        model.model.embed_tokens.weight.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path
