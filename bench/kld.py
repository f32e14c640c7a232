"""KL divergence of next-token distributions from the float32 dequantized model, and perplexity:
pagedserve's numerics (in process) and llama.cpp's `llama-perplexity --kl-divergence` on the
same GGUF file and text.

    python -m bench.kld [--model FILE.gguf] [--text /usr/share/common-licenses/GPL-3]
                        [--modes a32,a8] [--ctx 512] [--llama-cpp auto|none] [--out FILE.json]

The text is cut into chunks of --ctx tokens; as llama-perplexity does, each chunk is scored
on its second half (positions ctx/2 .. ctx-2 predicting the next token), so every scored
token has at least ctx/2 tokens of context. pagedserve runs each chunk as a prompt with
prompt logprobs through the engine (the served prefill path: chunked, a8's int8 activations
included) and the full logits of those positions are taken from the model's LM head; the
reference is the same file loaded with `--quantization none` (every weight dequantized to
float32). llama.cpp: the file requantized to F32 by `llama-quantize --allow-requantize`
(the same dequantized weights) gives the base logits, then the quantized file is compared.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.output import write_json

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def chunk_logprobs(llm: object, chunk: list[int]) -> torch.Tensor:
    """log-softmax [len(chunk) - 1, vocab] of the logits at every position but the last."""
    from ipc.messages import AddRequest
    from ipc.sampling import SamplingParams

    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    rows: list[torch.Tensor] = []
    inside = [False]
    plain_prompt, plain_logits = runner._prompt_logprobs, model.compute_logits

    def prompt_logprobs(*a: object) -> object:
        inside[0] = True
        try:
            return plain_prompt(*a)
        finally:
            inside[0] = False

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = plain_logits(hidden)
        if inside[0]:
            rows.append(torch.log_softmax(out.double(), -1).float())
        return out

    # NOTE: instance attributes over the methods, for this call only
    runner._prompt_logprobs, model.compute_logits = prompt_logprobs, compute_logits
    try:
        engine.add_request(AddRequest(
            request_id=f"kld-{id(chunk)}", prompt_token_ids=chunk,
            sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del runner._prompt_logprobs, model.compute_logits
    out = torch.cat(rows)
    assert out.shape[0] == len(chunk) - 1, out.shape
    return out


def pagedserve_kld(model: str, text: str, ctx: int, max_chunks: int, modes: list[str]) -> dict:
    """Chunks of the text (tokenized by the model's own tokenizer, no special tokens) through
    the float32 reference and each mode, one chunk at a time for all (no logits kept)."""
    from engine import LLM

    def load(quantization: str, numerics: str = "a32", kv: str = "auto") -> object:
        return LLM(model, quantization=quantization, quantization_numerics=numerics,
                   kv_cache_space=0.25, kv_cache_dtype=kv)

    ref = load("none")
    ids = ref.tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:max_chunks]
    llms = {m: load("gguf", m.split("-")[0], "float16" if "-f16kv" in m else "float32")
            for m in modes}
    stats = {m: {"kld": [], "nll": [], "top1": []} for m in ["float32", *modes]}
    for chunk in chunks:
        half = ctx // 2
        targets = torch.tensor(chunk[half + 1:])
        base = chunk_logprobs(ref, chunk)[half:]
        stats["float32"]["nll"] += (-base.gather(1, targets[:, None])[:, 0]).tolist()
        for m, llm in llms.items():
            lp = chunk_logprobs(llm, chunk)[half:]
            kld = (base.exp().double() * (base.double() - lp.double())).sum(-1)
            stats[m]["kld"] += kld.tolist()
            stats[m]["nll"] += (-lp.gather(1, targets[:, None])[:, 0]).tolist()
            stats[m]["top1"] += (lp.argmax(-1) == base.argmax(-1)).tolist()
    return {"text_tokens": len(ids), "chunks": len(chunks),
            **{m: summary(s) for m, s in stats.items()}}


def summary(s: dict) -> dict:
    n = len(s["nll"])
    out = {"tokens": n, "ppl": math.exp(sum(s["nll"]) / n)}
    if s["kld"]:
        kld = sorted(s["kld"])
        out |= {"kld_mean": sum(kld) / n, "kld_median": kld[n // 2],
                "kld_p99": kld[min(n - 1, int(0.99 * n))],
                "same_top1": sum(s["top1"]) / n}
    return out


def parse_perplexity(text: str) -> dict:
    """The figures llama-perplexity prints in its KL divergence summary."""
    found = {}
    for key, pattern in (("ppl", r"Mean PPL\(Q\)\s*:\s*([\d.]+)"),
                         ("ppl_base", r"Mean PPL\(base\)\s*:\s*([\d.]+)"),
                         ("kld_mean", r"Mean\s+KLD:\s*([-\d.]+)"),
                         ("kld_median", r"Median\s+KLD:\s*([-\d.]+)"),
                         ("kld_p99", r"99\.0%\s+KLD:\s*([-\d.]+)"),
                         ("same_top1", r"Same top p:\s*([\d.]+)")):
        m = re.search(pattern, text)
        if m:
            found[key] = float(m.group(1))
    if "same_top1" in found:
        found["same_top1"] /= 100
    return found


def llama_cpp_kld(model: str, text: Path, ctx: int, threads: int, chunks: int) -> dict:
    from bench import llama_cpp

    quantize, perplexity = (llama_cpp.binary(n) for n in ("llama-quantize", "llama-perplexity"))
    with tempfile.TemporaryDirectory(dir=llama_cpp.cache_root()) as tmp:
        f32, base = Path(tmp) / "f32.gguf", Path(tmp) / "base.kld"
        subprocess.run([quantize, "--allow-requantize", model, str(f32), "F32"], check=True,
                       capture_output=True)
        common = ["-f", str(text), "-c", str(ctx), "-t", str(threads), "--chunks", str(chunks)]
        subprocess.run([perplexity, "-m", str(f32), *common, "--kl-divergence-base", str(base)],
                       check=True, capture_output=True)
        done = subprocess.run([perplexity, "-m", model, *common, "--kl-divergence-base",
                               str(base), "--kl-divergence"], check=True, capture_output=True,
                              text=True)
    out = done.stdout + done.stderr
    return {**parse_perplexity(out), "summary": out[out.find("====== Perplexity"):][-3000:]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.kld", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--modes", default="a32,a8")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--max-chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp", default="auto", choices=["auto", "none"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from ipc.model_source import bundled_gguf

        args.model = str(bundled_gguf())
    result = {"model": args.model, "text": str(args.text), "ctx": args.ctx,
              "pagedserve": pagedserve_kld(args.model, args.text.read_text(), args.ctx,
                                           args.max_chunks,
                                           [m for m in args.modes.split(",") if m])}
    print(json.dumps(result, indent=1), flush=True)
    if args.llama_cpp == "auto":
        result["llama.cpp"] = llama_cpp_kld(args.model, args.text, args.ctx, args.threads,
                                            result["pagedserve"]["chunks"])
        print(json.dumps(result["llama.cpp"], indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
