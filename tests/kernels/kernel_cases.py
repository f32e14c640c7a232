"""Paged-attention cases against a float64 reference, shared by the CPU tests and the GPU check.

Plain functions (no pytest) so a worker process under TRITON_INTERPRET=1 and bench/gpu_check.sh
(`python tests/kernels/kernel_cases.py --device cuda`) run exactly what CI runs.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata, get_backend

FP8 = torch.float8_e4m3fn
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol) of the output against float64 on the same (rounded) inputs. A kernel's own
# roundings: scores (torch's CPU SDPA keeps them in the input dtype), P before P @ V, the output.
# Worst seen over 40 seeds x the matrix: fp16 2.3e-3, bf16 1.9e-2 (torch); about 2x margin.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
# (cached tokens, new tokens) per sequence, decodes first: lengths 1, 16, 17, 37 and chunks
# after cached prefixes that start mid-block and on a block boundary.
BATCHES = {
    "decode": [(0, 1), (15, 1), (16, 1), (36, 1)],
    "prefill": [(0, 17), (0, 16), (0, 5)],
    "mixed": [(16, 1), (0, 1), (40, 1), (0, 17), (5, 16), (16, 7), (33, 3)],
    # decodes long enough that 3 KV splits of 128 keys are all used, some partly or not at all;
    # a chunk after a long prefix and a long prefill: tiles the causal mask can skip
    "long": [(300, 1), (150, 1), (5, 1), (200, 20), (0, 150)],
    # for sliding windows (1, 16, 17, longer than any sequence): decodes and chunks whose
    # windows start mid-block, on a block boundary, before the sequence
    "window": [(40, 1), (16, 1), (0, 1), (70, 1), (0, 40), (30, 20), (17, 5), (48, 16)],
}
WINDOWS = (1, 16, 17, 1000)
MATRIX_BATCHES = ("decode", "prefill", "mixed")


@dataclass
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: the new tokens' K
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, page, num_kv_heads, head_dim], prefixes written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    k_full: list[torch.Tensor]  # per sequence [seq_len, kvh, d] float64, as stored (dequantized)
    v_full: list[torch.Tensor]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def make_batch(
    seqs: list[tuple[int, int]], *, kv_heads: int, group: int, head_dim: int,
    dtype: torch.dtype, kv_dtype: torch.dtype, scales: str | None, page: int, device: str,
    gen: torch.Generator, window: int | None = None, invariant: bool = False,
) -> Batch:
    """Random inputs; block tables are a random permutation of the pool, padded with valid ids.
    With a window, the blocks wholly before each sequence's first query's window are not
    written (garbage) and their table entries point at another block, as when the KV manager
    has released them."""
    need = [-(-(c + n) // page) for c, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, page, kv_heads, head_dim)
    # NOTE: finite garbage in unused slots: a kernel that reads past a mask gets wrong numbers.
    k_cache = _quantize(torch.randn(shape, generator=gen) * 8, kv_dtype, None)
    v_cache = _quantize(torch.randn(shape, generator=gen) * 8, kv_dtype, None)
    k_scale = v_scale = None
    if scales == "tensor":
        k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    elif scales == "head":
        k_scale = torch.rand(kv_heads, generator=gen) + 0.25
        v_scale = torch.rand(kv_heads, generator=gen) + 0.25
    width = max(need) + 1
    tables, slots, qs, keys, values, k_full, v_full = [], [], [], [], [], [], []
    for (ctx, n), nb in zip(seqs, need, strict=True):
        blocks, perm = perm[:nb], perm[nb:]
        gone = 0 if window is None else max(0, ctx - window + 1) // page
        tables.append([perm[-1]] * gone + blocks[gone:] + [perm[-1]] * (width - nb))
        total = ctx + n
        k = (torch.randn(total, kv_heads, head_dim, generator=gen) * 2).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(total)
        where = (torch.tensor(blocks)[pos // page], pos % page)
        kept = slice(gone * page, ctx)
        k_cache[where[0][kept], where[1][kept]] = _quantize(k[kept].float(), kv_dtype, k_scale)
        v_cache[where[0][kept], where[1][kept]] = _quantize(v[kept].float(), kv_dtype, v_scale)
        slots.append(where[0][ctx:] * page + where[1][ctx:])
        keys.append(k[ctx:])
        values.append(v[ctx:])
        k_full.append(_dequantize(_quantize(k.float(), kv_dtype, k_scale), k_scale))
        v_full.append(_dequantize(_quantize(v.float(), kv_dtype, v_scale), v_scale))
        qs.append(torch.randn(n, kv_heads * group, head_dim, generator=gen).to(dtype))
    qlens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    nd = sum(1 for n in qlens if n == 1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
        slot_mapping=torch.cat(slots).to(device),
        num_decodes=nd,
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        max_decode_seq_len=max(seq_lens[:nd], default=0),
        window=window,
        invariant=invariant,
    )
    dev = torch.device(device)
    return Batch(
        torch.cat(qs).to(dev), torch.cat(keys).to(dev), torch.cat(values).to(dev),
        k_cache.to(dev), v_cache.to(dev), meta, k_full, v_full,
        None if k_scale is None else k_scale.to(dev), None if v_scale is None else v_scale.to(dev),
    )


def _quantize(x: torch.Tensor, kv_dtype: torch.dtype, scale: torch.Tensor | None):
    if kv_dtype != FP8:
        return x.to(kv_dtype)
    if scale is not None:
        x = x / scale.view(-1, 1)
    return x.clamp(-448, 448).to(FP8)


def _dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    x = x.double()
    return x if scale is None else x * scale.double().view(-1, 1)


def reference(batch: Batch, scale: float, softcap: float | None = None) -> torch.Tensor:
    """float64 dense attention, bottom-right causal (within meta.window: a query at p sees
    keys p - window + 1 .. p), per sequence: [num_tokens, H, D]."""
    outs, start = [], 0
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    for k, v, n in zip(batch.k_full, batch.v_full, batch.meta.query_lens_cpu, strict=True):
        q = batch.q[start : start + n].double().cpu()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        total = k.shape[0]
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        position = (total - n + torch.arange(n))[:, None]
        visible = torch.arange(total)[None, :] <= position
        if batch.meta.window is not None:
            visible &= torch.arange(total)[None, :] > position - batch.meta.window
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += n
    return torch.cat(outs)


def check_attention(
    backend: str, batch_name: str, *, group: int, dtype: str = "float32", kv_dtype: str = "auto",
    scales: str | None = None, kv_heads: int = 2, head_dim: int = 32, page: int = 16,
    device: str = "cpu", mode: str = "auto", seed: int | None = None,
    window: int | None = None, softcap: float | None = None, invariant: bool = False,
) -> float:
    """Write the new K/V, attend, compare with float64; returns the largest abs error.

    mode (triton only): auto (production dispatch), varlen (one kernel for everything),
    split3 (decodes through the split-KV kernel with 3 splits).
    """
    seed = random.randrange(2**31) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    kvd = {"fp8_e4m3": FP8, "float16": torch.float16}.get(kv_dtype, dt)
    b = make_batch(BATCHES[batch_name], kv_heads=kv_heads, group=group, head_dim=head_dim,
                   dtype=dt, kv_dtype=kvd, scales=scales, page=page, device=device, gen=gen,
                   window=window, invariant=invariant)
    mod = get_backend(backend, torch.device(device).type)
    sc = {"k_scale": b.k_scale, "v_scale": b.v_scale}
    before = b.k_cache.view(torch.uint8).clone() if kvd == FP8 else b.k_cache.clone()
    mod.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping, **sc)
    _check_written(b, before, kvd, seed)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(b.q, float("nan"))  # poisoned: an unwritten element fails
    if mode == "varlen":
        mod.varlen_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, out, **sc)
    else:
        splits = {"auto": None, "split3": 3}[mode]
        extra = {"num_kv_splits": splits} if splits else {}
        if softcap is not None:
            extra["softcap"] = softcap
        mod.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, out=out, **sc, **extra)
    expected = reference(b, scale, softcap)
    atol, rtol = TOLERANCES[dt]
    got = out.double().cpu()
    msg = (f"seed={seed} backend={backend} batch={batch_name} group={group} {dtype}/{kv_dtype} "
           f"window={window} softcap={softcap}")
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{msg}\n{m}")
    return float((got - expected).abs().max())


def _check_written(b: Batch, before: torch.Tensor, kvd: torch.dtype, seed: int) -> None:
    # every new token's slot holds exactly its (quantized) K; every other slot is untouched
    kvh, d = b.k_cache.shape[2], b.k_cache.shape[3]
    raw = b.k_cache.view(torch.uint8) if kvd == FP8 else b.k_cache
    flat, old = raw.reshape(-1, kvh, d).cpu(), before.reshape(-1, kvh, d).cpu()
    slots = b.meta.slot_mapping.cpu()
    want = _quantize(b.key.float().cpu(), kvd, None if b.k_scale is None else b.k_scale.cpu())
    want = want.view(torch.uint8) if kvd == FP8 else want
    assert torch.equal(flat[slots], want), f"seed={seed}: written K differs"
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], old[untouched]), f"seed={seed}: other slots changed"


def check_write_padding(backend: str, device: str = "cpu") -> None:
    """Slot -1 is padding: skipped, nothing else written."""
    mod = get_backend(backend, torch.device(device).type)
    k_cache = torch.full((2, 16, 2, 32), 7.0, device=device)
    v_cache = torch.full((2, 16, 2, 32), 7.0, device=device)
    key = torch.randn(3, 2, 32, device=device)
    slots = torch.tensor([5, -1, 17], device=device)
    mod.write_kv(key, key * 2, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 2, 32)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[17], key[2])
    assert torch.equal(v_cache.view(-1, 2, 32)[17], key[2] * 2)
    assert int((flat != 7.0).any(-1).any(-1).sum()) == 2


def engine_greedy(model_dir: str, backend: str, max_tokens: int,
                  kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Greedy token ids of the in-process engine on a few prompts."""
    from engine.llm import LLM
    from ipc.sampling import SamplingParams

    llm = LLM(model_dir, attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
              device="cpu", max_model_len=256, num_gpu_blocks=64, max_num_batched_tokens=24)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a land far"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.token_ids for o in llm.generate(prompts, params)]


def enter_interpreter() -> None:
    """Worker-process initializer: must run before anything imports triton."""
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


# ---- the matrix, for `python tests/kernels/kernel_cases.py --device cuda` -----------------------

def matrix(backend: str) -> list[dict]:
    cases = [dict(backend=backend, batch_name=bn, group=g, dtype=dt)
             for bn in MATRIX_BATCHES for g in (1, 3, 4, 8) for dt in DTYPES]
    cases += [dict(backend=backend, batch_name="mixed", group=4, dtype=dt, kv_dtype="fp8_e4m3",
                   scales=sc) for dt in ("float16", "bfloat16") for sc in (None, "tensor", "head")]
    # a float16 cache under float32 (the CPU's) and bfloat16 (a GPU's) queries; flash_attn
    # refuses a cache dtype other than the model's
    if backend != "flash_attn":
        cases += [dict(backend=backend, batch_name="mixed", group=4, dtype=dt, kv_dtype="float16")
                  for dt in ("float32", "bfloat16")]
    # other block sizes, and a head dim that is not a power of two (masked lanes)
    cases += [dict(backend=backend, batch_name="mixed", group=3, dtype="float32", page=p)
              for p in (8, 32)]
    cases += [dict(backend=backend, batch_name="mixed", group=4, dtype="bfloat16", head_dim=24)]
    cases += [dict(backend=backend, batch_name="long", group=4, dtype="float32")]
    cases += window_cases(backend)
    if backend == "triton":
        cases += [dict(backend=backend, batch_name="mixed", group=g, dtype="bfloat16",
                       mode="varlen") for g in (1, 8)]
        cases += [dict(backend=backend, batch_name="long", group=g, dtype=dt, mode=m,
                       **kv) for g, dt, m, kv in (
                           (1, "float32", "split3", {}), (8, "bfloat16", "split3", {}),
                           (4, "float16", "split3", dict(kv_dtype="fp8_e4m3", scales="head")),
                           (4, "bfloat16", "varlen", {}))]
    return cases


def window_cases(backend: str) -> list[dict]:
    """Sliding windows of 1, 16, 17 and longer than the sequences; Gemma 2's soft-capping."""
    cases = [dict(backend=backend, batch_name="window", group=g, dtype="float32", window=w)
             for w in WINDOWS for g in (1, 4)]
    cases += [dict(backend=backend, batch_name="window", group=2, dtype=dt, window=17)
              for dt in ("float16", "bfloat16")]
    cases += [dict(backend=backend, batch_name="window", group=2, dtype="float32", window=w,
                   softcap=2.0) for w in (None, 17)]
    return cases


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backends", default="torch,triton,flash_attn")
    args = parser.parse_args()
    passed = failed = 0
    for backend in args.backends.split(","):
        try:
            get_backend(backend, torch.device(args.device).type)
        except (ImportError, ValueError) as e:
            print(f"skip {backend}: {e}")
            continue
        t0 = time.perf_counter()
        for case in matrix(backend):
            try:
                check_attention(device=args.device, **case)
                passed += 1
            except AssertionError as e:
                failed += 1
                print(f"FAIL {case}: {str(e)[:400]}")
        check_write_padding(backend, args.device)
        print(f"{backend}: done in {time.perf_counter() - t0:.1f}s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
