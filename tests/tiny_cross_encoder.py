"""Tiny random-weight cross-encoders: a `*ForSequenceClassification` of transformers' own
classes (Qwen3 or Llama, a `score` head of `num_labels` rows) with the bundled tokenizer, as
sentence-transformers' CrossEncoder loads one. A plain module (as tiny_embedder.py); built
once per variant, cached in /tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# NOTE: bump when the checkpoints change (cached across runs)
_VERSION = "v1"
_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", {"head_dim": 32}),
            "llama": ("LlamaConfig", "LlamaForSequenceClassification", {})}


def cross_encoder_dir(family: str = "qwen3", num_labels: int = 1, seed: int = 0) -> Path:
    """The checkpoint's directory, built on first use (a rename makes it appear whole)."""
    name = f"{family}-{num_labels}-{seed}"
    cache = Path(tempfile.gettempdir()) / f"pagedserve-test-cross-encoder-{_VERSION}-{name}"
    if (cache / "config.json").is_file():
        return cache
    tmp = Path(tempfile.mkdtemp(prefix=".cross-encoder-", dir=cache.parent))
    try:
        _build(tmp / "model", family, num_labels, seed)
        os.replace(tmp / "model", cache)
    except OSError:
        if not (cache / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def _build(path: Path, family: str, num_labels: int, seed: int) -> None:
    import torch
    import transformers

    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    config_cls, model_cls, extra = _CLASSES[family]
    # NOTE: pad_token_id 2 is the bundled tokenizer's pad (and eos) `<|im_end|>`: HF pools the
    # last token that is not it
    config = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        num_labels=num_labels, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    with torch.no_grad():  # states (and scores) that differ from pair to pair
        model.get_input_embeddings().weight.normal_(0, 0.5)
        model.score.weight.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir(resolve_model(None)).iterdir():
        shutil.copy(f, path / f.name)
    # NOTE: no chat template: sentence-transformers 6 renders pairs through one when the
    # tokenizer has it; without, it makes the tokenizer's text-pair call (what we serve)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = path / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    cfg.pop("chat_template", None)
    tok_cfg.write_text(json.dumps(cfg))
