"""The naive baseline: HF `generate` over static batches that wait for their longest member.

Shared by the offline benchmark and `bench/hf_static_server.py`. It is a baseline, not a server
design: one batch runs at a time, and a batch ends only when its longest request is done.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ipc.model_source import resolve_model


def load_model(model: str | None, device: str = "cpu"):
    """(model, tokenizer) in float32; a GGUF is dequantized by transformers + gguf."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.tokenizer import tokenizer_dir

    source = resolve_model(model)
    path: Path = source.path
    if source.is_gguf:
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(source))
    return hf.to(device).eval(), tok


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """input_ids and attention_mask, left-padded to the longest prompt: [B, max_len]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                   ignore_eos: bool = True, temperature: float = 0.0, streamer=None):
    """One static batch: every row decodes until the longest row's `max_new_tokens`."""
    ids, mask = pad_left(prompts, pad_id, model.device)
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id, streamer=streamer)
    if ignore_eos:
        # NOTE: min_new_tokens masks EOS until the end: every row produces max_new_tokens.
        kwargs["min_new_tokens"] = max_new_tokens
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def run_static(model, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
               batch_size: int, pad_id: int) -> dict:
    """The workload in arrival order, `batch_size` at a time; counts only requested tokens."""
    start = time.perf_counter()
    steps = 0
    for i in range(0, len(prompts), batch_size):
        chunk = range(i, min(i + batch_size, len(prompts)))
        longest = max(output_lens[j] for j in chunk)
        generate_batch(model, [prompts[j] for j in chunk], longest, pad_id)
        steps += longest
    elapsed = time.perf_counter() - start
    out_tokens = sum(output_lens)
    total = out_tokens + sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "steps": steps, "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / elapsed, "total_tok_per_s": total / elapsed}
