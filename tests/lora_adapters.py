"""Random PEFT LoRA adapters for tests and the adapter bench, made by peft itself
(LoraConfig + get_peft_model + save_pretrained) on a base loaded with transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

# name -> LoraConfig keywords: ranks, scalings (rsLoRA too) and target sets that differ
ADAPTERS: dict[str, dict] = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"]),
    "qv": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=16, lora_alpha=24, target_modules=["o_proj", "gate_proj", "down_proj"],
                rank_pattern={"down_proj": 4}),
}


def build_adapter(base_dir: Path, out: Path, seed: int, scale: float = 4.0,
                  **lora_config) -> Path:
    """A PEFT adapter of random A and B (B is zero at PEFT's default init: no effect), saved
    as adapter_config.json + adapter_model.safetensors."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0,
                                            init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, scale / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


def peft_model(base_dir: Path, adapter_dir: Path):
    """HF PEFT's PeftModel of the base and adapter: the reference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def dequantized_copy(hf_dir: Path, out: Path, type_name: str) -> Path:
    """The HF checkpoint with each weight as tests/tiny_quant_gguf.py writes it, dequantized by
    the `gguf` package (linears in `type_name`, the embedding Q8_0): the quantized base's
    reference. NOTE: rows quantize independently, so the q/k row interleave is left out."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(f).items():
            t = t.astype(np.float32)
            if t.ndim == 2:
                kind = gguf.GGMLQuantizationType[
                    "Q8_0" if name == "model.embed_tokens.weight" else type_name]
                t = dequantize(quantize(t, kind), kind).astype(np.float32)
            tensors[name] = t
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out
