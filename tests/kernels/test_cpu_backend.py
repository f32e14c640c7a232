"""The cpu backend (float32 decodes in C through the block table) against float64, with and
without split-KV, and its build: cache, no process-wide flush-to-zero, fallback without a
compiler."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import c_build
import pytest
import torch
from kernel_cases import (
    TOLERANCES,
    check_attention,
    check_write_padding,
    engine_greedy,
    make_batch,
    matrix,
    reference,
)

from kernels import auto_backend, get_backend
from kernels.attention.metadata import AttentionMetadata

ROOT = Path(__file__).resolve().parents[2]
try:
    from kernels.attention import cpu_backend
except ImportError as e:
    cpu_backend, BUILD_ERROR = None, str(e)
else:
    BUILD_ERROR = None


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(BUILD_ERROR)


@pytest.mark.parametrize("case", matrix("cpu"), ids=lambda c: "-".join(map(str, c.values())))
def test_cpu_backend_matches_float64(case):
    check_attention(**case)


# The vectorized path (head_dim 64 or 128, groups 1-8; 256, Gemma's, groups 1, 2 and 4;
# 16-token chunks, so blocks of 8 leave lanes empty and blocks of 32 and 64 hold several
# chunks) and the scalar one beside it.
@pytest.mark.parametrize(("head_dim", "group", "page"), [
    (64, 1, 16), (64, 3, 16), (64, 8, 16), (128, 3, 16), (128, 8, 16),
    (256, 1, 16), (256, 2, 16), (256, 4, 16), (256, 4, 8),
    (64, 3, 8), (64, 3, 32), (64, 2, 64), (64, 12, 16), (96, 3, 16), (256, 3, 16)])
def test_decode_shapes_match_float64(head_dim, group, page):
    check_attention("cpu", "long", group=group, head_dim=head_dim, page=page)


# Batch-invariant prefill (AttentionMetadata.invariant, the engine's default): every prefill
# token attends through the decode kernel at its position; chunks after a cached prefix, chunks
# of one token, windows that start mid-block, head dims 64 and 256.
@pytest.mark.parametrize("batch", ["prefill", "mixed", "long", "window"])
@pytest.mark.parametrize("kv_dtype", ["float16", "auto"])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 256)])
def test_invariant_prefill_matches_float64(batch, kv_dtype, group, head_dim):
    for window in ([None, 1, 17] if batch == "window" else [None]):
        check_attention("cpu", batch, group=group, head_dim=head_dim, kv_dtype=kv_dtype,
                        window=window, invariant=True)


@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("kv_dtype", ["float16", "auto"])
def test_head_dim_256_matches_float64(kv_dtype, window):
    """Gemma 3 270M's and 1B's heads: one KV head for four queries, float16 or float32 pools,
    its 512-token window scaled down to windows that start mid-block."""
    check_attention("cpu", "long", group=4, kv_heads=1, head_dim=256, kv_dtype=kv_dtype,
                    window=window)


def test_cpu_write_kv_skips_padding():
    check_write_padding("cpu")


def test_cpu_write_kv_of_strided_rows_equals_the_torch_backend():
    """K and V as the model passes them: views into the fused qkv rows."""
    from kernels.attention import torch_backend

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 5, 16, generator=gen)  # [tokens, 3 q + 1 k + 1 v heads, head_dim]
    key, value = qkv[:, 3:4], qkv[:, 4:5]
    slots = torch.tensor([0, 17, -1, 3, 31, 8, -1, 9, 2])
    caches = [torch.zeros(2, 16, 1, 16) for _ in range(4)]
    cpu_backend.write_kv(key, value, caches[0], caches[1], slots)
    torch_backend.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError, match="out of range"):
        cpu_backend.write_kv(key, value, caches[0], caches[1], slots + 32)


# (cached, new) decodes: one long sequence split across threads, and beside it a short one
# whose later splits hold no blocks; a short sequence alone, split only because it is fewer
# than the threads (13 blocks in 3 uneven splits: 5, 5 and 3).
# With a window, the splits cover the window's blocks only (its first one from mid-block).
@pytest.mark.parametrize("seqs", [[(2100, 1)], [(2100, 1), (3, 1)], [(600, 1), (1200, 1)],
                                  [(200, 1)]])
@pytest.mark.parametrize("num_threads", [1, 2, 8])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 1, 777])
def test_split_kv_decode_matches_float64(seqs, num_threads, group, window):
    gen = torch.Generator().manual_seed(len(seqs) * 100 + num_threads * 10 + group)
    b = make_batch(seqs, kv_heads=1, group=group, head_dim=64, dtype=torch.float32,
                   kv_dtype=torch.float32, scales=None, page=16, device="cpu", gen=gen,
                   window=window)
    cpu_backend.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    scale = 1 / math.sqrt(64)
    out = torch.full_like(b.q, float("nan"))
    assert cpu_backend.fits(b.q, b.k_cache, b.v_cache, out, None, None, b.meta)
    cpu_backend.decode(b.q, b.k_cache, b.v_cache, b.meta, scale, out, num_threads=num_threads)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.double(), reference(b, scale), atol=atol, rtol=rtol)


def test_what_the_kernel_does_not_take_goes_to_torch():
    gen = torch.Generator().manual_seed(0)
    b = make_batch([(20, 1), (0, 5)], kv_heads=2, group=2, head_dim=16, dtype=torch.bfloat16,
                   kv_dtype=torch.bfloat16, scales=None, page=16, device="cpu", gen=gen)
    out = torch.empty_like(b.q)
    assert not cpu_backend.fits(b.q, b.k_cache, b.v_cache, out, None, None, b.meta)
    f32 = make_batch([(20, 1)], kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
                     kv_dtype=torch.float32, scales=None, page=128, device="cpu", gen=gen)
    out = torch.empty_like(f32.q)
    assert not cpu_backend.fits(f32.q, f32.k_cache, f32.v_cache, out, None, None, f32.meta)


def test_loading_the_kernel_keeps_denormals():
    """-ffast-math objects must not bring crtfastmath's process-wide flush-to-zero."""
    code = ("import torch\n"
            "import kernels.attention.cpu_backend\n"
            "x = torch.tensor([1e-40])\n"
            "assert (x / 2).item() != 0.0, 'denormals flushed'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_without_a_compiler_auto_is_torch(tmp_path):
    code = ("import kernels\n"
            "assert kernels.auto_backend('cpu') == 'torch'\n"
            "try:\n"
            "    kernels.get_backend('cpu')\n"
            "except ValueError as e:\n"
            "    assert 'C compiler' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no error')\n")
    env = {**os.environ, "PATH": str(tmp_path), "CC": "no-such-cc",
           "PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120, env=env)


def test_the_build_is_cached_per_source_and_machine(tmp_path):
    # NOTE: kernels/cc_build.py on a one-line source (the whole CPU library takes 10-15 s to
    # build): two processes build it once, an edited source is a second library
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    src = tmp_path / "one.c"
    code = ("import sys; from pathlib import Path; from kernels import cc_build; "
            "print(cc_build.build('one', [(Path(sys.argv[1]), ['-O2', '-fPIC'])]).one())")

    def run() -> str:
        return subprocess.run([sys.executable, "-c", code, str(src)], cwd=ROOT, check=True,
                              timeout=120, env=env, capture_output=True, text=True).stdout
    src.write_text("int one(void) { return 1; }\n")
    assert run() == "1\n"
    built = list((tmp_path / "cache" / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", built
    stamp = built[0].stat().st_mtime_ns
    assert run() == "1\n" and built[0].stat().st_mtime_ns == stamp  # NOTE: loaded, not rebuilt
    src.write_text("int one(void) { return 2; }\n")
    assert run() == "2\n"
    assert len(list((tmp_path / "cache" / "kernels").iterdir())) == 2


def test_auto_is_cpu_here():
    assert auto_backend("cpu") == "cpu"
    assert get_backend("auto", "cpu") is cpu_backend
    with pytest.raises(ValueError, match="CPU only"):
        get_backend("cpu", "cuda")


def test_engine_greedy_equals_the_torch_backend(tiny_model_dir):
    assert (engine_greedy(str(tiny_model_dir), "cpu", 16)
            == engine_greedy(str(tiny_model_dir), "torch", 16))


def _decodes(b, rows: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """The decode batch of sequences `rows` of `b` (in that order)."""
    m, idx = b.meta, torch.tensor(rows)
    lens = [m.seq_lens_cpu[r] for r in rows]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=m.seq_lens[idx], block_tables=m.block_tables[idx],
        slot_mapping=m.slot_mapping[idx], num_decodes=len(rows), query_lens_cpu=[1] * len(rows),
        seq_lens_cpu=lens, max_decode_seq_len=max(lens), window=m.window)
    return b.q[idx], meta


# Batch invariance: a sequence's decode output is the same bits whatever its batch mates, its
# row, and the thread count (the split of its keys is a function of its own length). Lengths
# from one block (no split) to 2100 keys (33 splits), windows that start mid-block.
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 777])
def test_decode_is_the_same_bits_whatever_its_batch_and_threads(kv_dtype, window):
    seqs = [(200, 1), (2100, 1), (3, 1), (600, 1), (70, 1)]
    b = make_batch(seqs, kv_heads=2, group=3, head_dim=64, dtype=torch.float32,
                   kv_dtype=kv_dtype, scales=None, page=16, device="cpu",
                   gen=torch.Generator().manual_seed(7), window=window)
    scale = 1 / math.sqrt(64)

    def run(rows: list[int], threads: int) -> dict[int, torch.Tensor]:
        q, meta = _decodes(b, rows)
        out = torch.full_like(q, float("nan"))
        cpu_backend.decode(q, b.k_cache, b.v_cache, meta, scale, out, num_threads=threads)
        return dict(zip(rows, out, strict=True))

    everyone = list(range(len(seqs)))
    ref = run(everyone, 2)
    runs = [run(everyone, 1), run(everyone, 8), run(everyone[::-1], 2),
            *(run([r], t) for r in everyone for t in (1, 2)), run([1, 3], 2)]
    for got in runs:
        for r, out in got.items():
            assert torch.equal(out, ref[r]), (r, got.keys())
