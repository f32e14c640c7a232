"""The model hyper-parameters the engine needs, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, per byte of the cache dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


_LLAMA_FAMILY = {"llama", "mistral", "qwen2", "smollm"}


def from_hf_config(model_dir: Path) -> ModelConfig:
    """Read an HF config.json (and generation_config.json for extra EOS ids)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg.get("model_type", "llama")
    if model_type not in _LLAMA_FAMILY:
        raise ValueError(f"model_type {model_type!r} is not supported (Llama family only)")
    heads = cfg["num_attention_heads"]
    eos = _as_tuple(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += tuple(e for e in _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id"))
                     if e not in eos)
    rope_scaling = cfg.get("rope_scaling") or _rope_parameters_scaling(cfg)
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
        architecture=model_type,
    )


def _rope_parameters_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") == "default":
        return None
    return params


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
