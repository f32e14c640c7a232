"""A Llama-3.2-1B-shaped checkpoint with random weights, for speed at the size real
deployments run (issue 31, item 4); cached outside the repo, never in CI.

    python -m bench.model_1b build          # HF checkpoint, F16 GGUF, Q4_K_M and Q4_0 files
    python -m bench.model_1b path Q4_K_M    # one built file (Q4_K_M, Q4_0, F16)
    python -m bench.model_1b check          # the F16 file in pagedserve (a32) against HF

The checkpoint is transformers' LlamaForCausalLM with Llama 3.2 1B's shapes (hidden 2048, 16
layers, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 128256, tied embeddings, llama3 RoPE
scaling with base 500000), seeded random weights in bfloat16, and the bundled model's
tokenizer (llama.cpp's converter pads its 49152 tokens to the vocabulary with [PAD] entries).
It is converted by the vendored tree's `convert_hf_to_gguf.py` and quantized by its
`llama-quantize` (bench/llama_cpp.py builds both tools). Random weights decode at the speed of
real ones: every token reads every weight once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import llama_cpp
from ipc.model_source import cache_root

SHAPE = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192},
)
KINDS = ("Q4_K_M", "Q4_0", "F16")


def root() -> Path:
    return cache_root() / "llama-3.2-1b-shaped"


def path(kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    return root() / f"llama-3.2-1b-shaped-{kind.lower()}.gguf"


def build_hf(out: Path, seed: int = 0) -> Path:
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer_dir(resolve_model(None)).iterdir():
        shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def convert(hf: Path, out: Path) -> Path:
    """The vendored converter, F16; its own gguf-py goes first on the path, as in its tree."""
    if out.exists():
        return out
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        # NOTE: the converter's Llama vocabulary tries SentencePiece first and catches only a
        # missing tokenizer.model, not a missing module, before its BPE path (ours)
        raise SystemExit("the vendored convert_hf_to_gguf.py needs the sentencepiece "
                         "module: pip install sentencepiece") from None
    tree = llama_cpp.source_tree()
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"), NO_LOCAL_GGUF="")
    tmp = out.with_name(out.name + ".partial")
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf),
                    "--outtype", "f16", "--outfile", str(tmp)], check=True, env=env)
    tmp.rename(out)
    return out


def quantize(f16: Path, kind: str) -> Path:
    out = path(kind)
    if out.exists():
        return out
    tool = llama_cpp.binary("llama-quantize")
    tmp = out.with_name(out.name + ".partial")
    subprocess.run([str(tool), str(f16), str(tmp), kind, "2"], check=True)
    tmp.rename(out)
    return out


def build() -> dict[str, Path]:
    hf = build_hf(root() / "hf")
    f16 = convert(hf, path("F16"))
    return {"F16": f16} | {k: quantize(f16, k) for k in ("Q4_K_M", "Q4_0")}


def check(prompt_len: int = 300, top: int = 3) -> dict:
    """The converted F16 file (bfloat16 weights exactly) in pagedserve's exact a32 mode against
    HF transformers' float32 model of the checkpoint: the RoPE frequencies (llama.cpp's
    rope_freqs factors against HF's llama3 scaling) and every prompt token's top logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.models.llama import rope_inv_freq

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 49000, (prompt_len,), generator=g).tolist()
    hf = AutoModelForCausalLM.from_pretrained(root() / "hf", dtype=torch.float32).eval()
    hf_inv = hf.model.rotary_emb.inv_freq.float()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    del hf
    llm = LLM(model=str(path("F16")), quantization_numerics="a32", max_model_len=1024)
    cfg = llm.engine.model_config
    inv_gap = float(((rope_inv_freq(cfg)[0] - hf_inv).abs() / hf_inv).max())
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top))[0]
    gap = max(abs(v - float(ref[j - 1, t])) for j in range(1, prompt_len)
              for t, v in out.prompt_logprobs[j].items())
    result = {"rope_scaling": cfg.rope_scaling["rope_type"], "inv_freq_max_rel_gap": inv_gap,
              "prompt_logprob_max_abs_gap": gap, "prompt_len": prompt_len}
    print(result)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["build", "path", "check"])
    p.add_argument("kind", nargs="?", default="Q4_K_M", choices=KINDS)
    args = p.parse_args(argv)
    if args.what == "build":
        for kind, f in build().items():
            print(f"{kind}: {f} ({f.stat().st_size / 1e6:.0f} MB)")
    elif args.what == "check":
        check()
    else:
        print(path(args.kind))


if __name__ == "__main__":
    main()
