"""The model hyper-parameters the engine needs, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
import math
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
    # Per layer: its sliding window W (a query at position p sees keys p-W+1 .. p, W keys with
    # itself, as HF's masks), or None for global attention; () means every layer is global.
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh" (Gemma)
    norm_offset: float = 0.0  # Gemma's RMSNorms scale by (1 + w): folded into w at load
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP as well
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # Gemma 3: the rope base of the windowed layers
    # Why the context stops at max_position_embeddings when that is not the checkpoint's own
    # limit (Phi-3's long rope factor is not implemented).
    context_limit_reason: str = ""
    # A `*ForSequenceClassification` checkpoint (a cross-encoder): its `score` head's rows
    # (None: a causal LM, which has an LM head instead), and the pad id HF's head skips when
    # it pools the last token (None: the last token, whatever it is)
    num_labels: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError("layer_windows must give one window (or None) per layer")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError("layer_windows must be >= 1")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, per byte of the cache dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer keeps, when all layers are windowed: the KV manager may
        drop blocks older than it. None when any layer is global (nothing can be dropped)."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)


# model_type -> what differs from Llama's layout (HF config field names are read below)
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "smollm": {}, "mistral": {}, "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True}, "phi3": {},
    "gemma2": {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "sandwich_norms": True},
    "gemma3_text": {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "sandwich_norms": True,
                    "qk_norm": True},
}


def from_hf_config(model_dir: Path) -> ModelConfig:
    """Read an HF config.json (and generation_config.json for extra EOS ids)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg.get("model_type", "llama")
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{sorted(_FAMILIES)}")
    family = _FAMILIES[model_type]
    heads = cfg["num_attention_heads"]
    eos = _as_tuple(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += tuple(e for e in _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id"))
                     if e not in eos)
    rope = _rope(cfg, model_type)
    gemma = model_type.startswith("gemma")
    fields: dict[str, Any] = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        attention_bias=cfg.get("attention_bias", family.get("attention_bias", False)),
        architecture=model_type,
        layer_windows=hf_layer_windows(cfg, model_type),
        qk_norm=family.get("qk_norm", False),
        hidden_act=family.get("hidden_act", "silu"),
        norm_offset=family.get("norm_offset", 0.0),
        sandwich_norms=family.get("sandwich_norms", False),
        embed_scale=math.sqrt(cfg["hidden_size"]) if gemma else None,
        attn_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma else None,
        attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
        final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        **_classifier(cfg),
    )
    return ModelConfig(**(fields | rope))


_SIGMOID = "torch.nn.modules.activation.Sigmoid"


def _classifier(cfg: dict[str, Any]) -> dict[str, Any]:
    """num_labels and pad_token_id of a `*ForSequenceClassification` checkpoint (nothing for
    a causal LM). One label only: its sigmoid is the relevance score (as sentence-transformers'
    CrossEncoder and vLLM score); a classifier of several labels is refused."""
    arch = next((a for a in cfg.get("architectures") or []
                 if a.endswith("ForSequenceClassification")), None)
    if arch is None:
        return {}
    # NOTE: transformers writes id2label (num_labels is derived from it; 2 without one)
    labels = len(cfg["id2label"]) if cfg.get("id2label") else int(cfg.get("num_labels", 2))
    if labels != 1:
        raise ValueError(f"{arch} with {labels} labels: only cross-encoders of one label (a "
                         "relevance score) are served, for /v1/rerank and /score")
    # NOTE: sentence-transformers' CrossEncoder reads its activation here (the older key too)
    activation = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function")
    if activation not in (None, _SIGMOID):
        raise ValueError(f"{arch}: its config asks for the activation {activation}; only the "
                         "sigmoid of the score is served")
    return {"num_labels": labels, "pad_token_id": cfg.get("pad_token_id")}


def hf_layer_windows(cfg: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    """Each layer's window from `layer_types` (transformers 5 writes it), else the family's
    rule as its config class derives it."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        if model_type in ("qwen2", "qwen3"):
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full" for i in range(n)]
        elif model_type == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full" for i in range(n)]
        elif model_type == "gemma3_text":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full" for i in range(n)]
        else:  # Mistral, Phi-3: every layer
            types = ["sliding_attention"] * n
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _rope(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """rope_theta, rope_scaling (and the local base, the context cap) from either the
    transformers 4 fields (rope_theta, rope_scaling) or the 5 ones (rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    out: dict[str, Any] = {}
    if "full_attention" in params:  # Gemma 3: one set per layer type
        local = params.get("sliding_attention") or {}
        out["local_rope_theta"] = local.get("rope_theta", 10000.0)
        params = params["full_attention"]
    elif model_type == "gemma3_text":
        out["local_rope_theta"] = cfg.get("rope_local_base_freq", 10000.0)
    out["rope_theta"] = cfg.get("rope_theta") or params.get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling") or (
        None if params.get("rope_type", "default") == "default" else params)
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in ("su", "longrope"):
            out.update(longrope_context(cfg, scaling))
        if float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1:
            raise ValueError("partial_rotary_factor below 1 is not supported")
    out["rope_scaling"] = scaling
    return out


def longrope_context(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's su/longrope: the short factor only, so the context stops at the original
    length (HF switches to the long factor past it)."""
    original = scaling.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings") or cfg["max_position_embeddings"]
    longest = cfg["max_position_embeddings"]
    if "attention_factor" not in scaling:
        factor = scaling.get("factor") or longest / original
        scaling["attention_factor"] = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
    scaling["rope_type"] = "longrope"
    reason = ""
    if longest > original:
        reason = (f"rope scaling longrope: only its short factor is implemented, which covers "
                  f"{original} positions (the checkpoint's long factor reaches {longest})")
    return {"max_position_embeddings": original, "context_limit_reason": reason}


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
