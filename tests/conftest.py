"""Shared fixtures: the bundled model's files, and tiny random-weight Llama models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bundled_tokenizer_dir() -> Path:
    """Tokenizer files of the bundled model (exported from its GGUF once, then cached)."""
    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    return tokenizer_dir(resolve_model(None))


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_tokenizer_dir) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads) and the bundled tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_tokenizer_dir)
