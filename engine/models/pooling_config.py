"""How a checkpoint pools embeddings: its sentence-transformers config (modules.json with a
Pooling and maybe a Normalize module) when it has one, else the decoder default, with the
engine's --pooling over either; and Matryoshka truncation from config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ipc.pooling import PoolingInfo

# sentence-transformers' pooling_mode names (and the booleans of its older configs) -> ours
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
# NOTE: modules that change nothing the engine computes; any other (Dense, LayerNorm, ...) is
# a transform we do not run, so its config is refused rather than half applied
_ST_PASSIVE = {"Transformer", "Pooling", "Normalize"}


def pooling_info(model_dir: Path | None, dimensions: int, override: str | None,
                 num_labels: int | None = None) -> PoolingInfo:
    """The model's pooling (model_dir None: a GGUF file, which has no such config).
    num_labels: a cross-encoder's (its score head pools the last token, nothing to choose)."""
    if num_labels is not None:
        if override is not None:
            raise ValueError(f"pooling {override}: this model is a cross-encoder (a sequence "
                             "classifier), which pools the last token with its score head")
        return PoolingInfo(dimensions=num_labels, method="last", normalize=False,
                           source="classifier", num_labels=num_labels)
    hf = _json(model_dir / "config.json") if model_dir is not None else None
    matryoshka = (hf or {}).get("matryoshka_dimensions")
    shape: dict[str, Any] = dict(
        dimensions=dimensions,
        matryoshka_dimensions=tuple(int(d) for d in matryoshka) if matryoshka else None,
        is_matryoshka=bool((hf or {}).get("is_matryoshka") or matryoshka))
    modules = _json(model_dir / "modules.json") if model_dir is not None else None
    if override is not None:
        normalize = True if modules is None else _has(modules, "Normalize")
        return PoolingInfo(method=override, normalize=normalize, source="--pooling", **shape)
    if modules is None:
        # NOTE: vLLM's default for decoder embedding models: the last token, normalized
        return PoolingInfo(method="last", normalize=True, source="default", **shape)
    assert model_dir is not None
    return PoolingInfo(method=_st_method(model_dir, modules), normalize=_has(modules, "Normalize"),
                       source="sentence-transformers", **shape)


def _st_method(model_dir: Path, modules: list[dict[str, Any]]) -> str:
    for m in modules:
        kind = _kind(m)
        if kind not in _ST_PASSIVE:
            raise ValueError(f"{model_dir / 'modules.json'}: module {m.get('type')!r} is not "
                             "run by pagedserve (start with --pooling to pool without it)")
    pools = [m for m in modules if _kind(m) == "Pooling"]
    if not pools:
        raise ValueError(f"{model_dir / 'modules.json'} has no Pooling module (start with "
                         "--pooling to choose one)")
    cfg = _json(model_dir / pools[0].get("path", "") / "config.json") or {}
    if isinstance(cfg.get("pooling_mode"), str):
        modes = [cfg["pooling_mode"]]
        method = _ST_MODES.get(modes[0])
    else:
        modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
        method = _ST_FLAGS.get(modes[0]) if len(modes) == 1 else None
    if method is None:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {modes} is not one of "
                         f"{sorted(_ST_MODES)} (start with --pooling to choose one)")
    return method


def _kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _has(modules: list[dict[str, Any]], kind: str) -> bool:
    return any(_kind(m) == kind for m in modules)


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None
