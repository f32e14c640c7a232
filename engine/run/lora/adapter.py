"""Reads a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into per-layer
A/B matrices keyed by HF module name, refusing what this engine cannot apply, by name."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# HF module name -> (our fused linear, part index within it)
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# PEFT options whose effect this engine does not reproduce: refused, never ignored
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "alpha_pattern":
            "alpha_pattern", "modules_to_save": "modules_to_save", "layer_replication":
            "layer_replication"}


@dataclass
class ModuleLora:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], scaling folded in


@dataclass
class LoraWeights:
    name: str
    rank: int  # the largest of its modules' ranks
    modules: dict[tuple[int, str], ModuleLora]  # (layer, HF module name) -> its matrices

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def read_adapter(name: str, path: str, max_rank: int, num_layers: int,
                 dtype: torch.dtype) -> LoraWeights:
    """The adapter at `path`; ValueError naming the adapter and the fault otherwise."""
    from safetensors.torch import load_file  # NOTE: lazily: only engines with LoRA read one

    root = Path(path)
    config = _config(name, root)
    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path} "
                         "(pickled adapter_model.bin is not read)")
    try:
        tensors = load_file(weights_file)
    except Exception as exc:  # NOTE: a corrupt file is the client's input: say so
        raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_file}: {exc}") from exc
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} targets a module this "
                             f"engine does not adapt (only {sorted(TARGETS)})")
        layer = int(m.group(1))
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}, but the model has "
                             f"{num_layers} layers")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {weights_file}")
    modules = {k: _module(name, k, p, config, dtype) for k, p in pairs.items()}
    rank = max(m.a.shape[0] for m in modules.values())
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank "
                         f"{max_rank}")
    return LoraWeights(name, rank, modules)


def _config(name: str, root: Path) -> dict:
    file = root / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {root} has no adapter_config.json")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: bad adapter_config.json: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is "
                         "not LORA")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported "
                         "(only 'none')")
    if not isinstance(config.get("lora_alpha"), int | float):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json has no lora_alpha")
    return config


def _module(name: str, key: tuple[int, str], pair: dict[str, torch.Tensor], config: dict,
            dtype: torch.dtype) -> ModuleLora:
    if set(pair) != {"A", "B"}:
        raise ValueError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]} lacks lora_A or "
                         "lora_B")
    a, b = pair["A"], pair["B"]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise ValueError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]}: lora_A "
                         f"{tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
    # NOTE: PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (r: this
    # module's rank, which rank_pattern may set per module)
    alpha = float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return ModuleLora(a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous())
