"""EngineConfig's device and dtype names as torch objects (the engine and headless nodes)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # NOTE: the CPU here has no bf16 matrix units: float32 is the fast dtype on CPU.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]
