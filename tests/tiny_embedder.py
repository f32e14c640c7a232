"""Tiny random-weight embedding checkpoints as sentence-transformers saves them: a base model
of transformers' own classes (Qwen3Model, as Qwen3-Embedding; LlamaModel), the bundled
tokenizer, and modules.json with a Pooling module (last token, mean or CLS) and optionally a
Normalize module. A plain module (as tiny_llama.py); built once per variant, cached in /tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# NOTE: bump when the checkpoints change (cached across runs)
_VERSION = "v2"
_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def embedder_dir(method: str, normalize: bool = True, family: str = "qwen3",
                 matryoshka: list[int] | None = None, seed: int = 0) -> Path:
    """The checkpoint's directory, built on first use (a rename makes it appear whole)."""
    name = f"{family}-{method}-{'norm' if normalize else 'raw'}-{matryoshka or 'full'}-{seed}"
    cache = Path(tempfile.gettempdir()) / f"pagedserve-test-embedder-{_VERSION}-{name}"
    if (cache / "modules.json").is_file():
        return cache
    tmp = Path(tempfile.mkdtemp(prefix=".embedder-", dir=cache.parent))
    try:
        _build(tmp, method, normalize, family, matryoshka, seed)
        os.replace(tmp / "st", cache)
    except OSError:
        if not (cache / "modules.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def _build(tmp: Path, method: str, normalize: bool, family: str, matryoshka: list[int] | None,
           seed: int) -> None:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "qwen3":
        config, model_cls = transformers.Qwen3Config(head_dim=32, **common), "Qwen3Model"
    else:
        config, model_cls = transformers.LlamaConfig(**common), "LlamaModel"
    if matryoshka is not None:
        config.matryoshka_dimensions = matryoshka  # NOTE: read as vLLM reads it
        config.is_matryoshka = True
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    with torch.no_grad():  # states that differ from token to token: pooling choices matter
        model.get_input_embeddings().weight.normal_(0, 0.5)
    model.save_pretrained(tmp / "hf", safe_serialization=True)
    for f in tokenizer_dir(resolve_model(None)).iterdir():
        shutil.copy(f, tmp / "hf" / f.name)
    # NOTE: no chat template: sentence-transformers 6 renders plain text through one when the
    # tokenizer has it, and /v1/embeddings embeds the text as given (as vLLM does)
    (tmp / "hf" / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = tmp / "hf" / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    cfg.pop("chat_template", None)
    tok_cfg.write_text(json.dumps(cfg))
    modules = [models.Transformer(str(tmp / "hf")),
               models.Pooling(64, pooling_mode=_MODES[method])]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp / "st"))
    # NOTE: save() rewrites config.json from the model's config: keep the Matryoshka keys
    saved = json.loads((tmp / "st" / "config.json").read_text())
    assert (matryoshka is None) or saved.get("matryoshka_dimensions") == matryoshka
