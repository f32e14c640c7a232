"""CPU backend: float32 decodes in a C kernel that reads K/V through the block table.

The torch backend gathers each decode's blocks into a contiguous copy before its SDPA, which
reads and writes the whole cache once more than attention itself needs. `cpu_decode.c` walks
the blocks in place with an online softmax, one OpenMP task per sequence (16 tokens' scores
per vector for head dims of 64 and 128), and splits long sequences across threads when those
tasks are too few (split-KV). It is
compiled here on first use with the system C compiler (`-O3 -march=native`) into
`$PAGEDSERVE_CACHE/kernels/` and loaded with ctypes; it links the libgomp torch has already
loaded, so both share one thread pool. KV writes of float32 rows are one C call too. Prefill
chunks, other dtypes and the FP8 cache go to the torch backend. Without a C compiler the
backend is unavailable and `auto` stays on torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels import torch_backend
from kernels.metadata import AttentionMetadata

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# NOTE: linked in a second step without -ffast-math: gcc < 13 links crtfastmath.o into a
# -ffast-math shared library, which turns on flush-to-zero for the whole process when loaded.
LINK = ["-shared", "-fopenmp"]
MAX_GROUP, MAX_BLOCK, MAX_ROWS = 64, 64, 4096  # the C kernel's stack arrays



def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise ImportError("the cpu attention backend needs a C compiler (cc or gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, *LINK, version, _cpu_flags()])
                         .encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
    lib = root / "kernels" / f"cpu_decode-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            obj, built = Path(tmp) / "cpu_decode.o", Path(tmp) / lib.name
            for cmd in ([cc, *FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                        [cc, *LINK, str(obj), "-o", str(built), "-lm"]):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise ImportError(f"building {SOURCE.name} failed: {done.stderr.strip()[:500]}")
            os.replace(built, lib)  # NOTE: atomic: concurrent builders all end with one file
    so = ctypes.CDLL(str(lib))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    so.paged_decode_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64,
                                    i32, i32, i32, i32, i32, ctypes.c_float, i32]
    so.write_kv_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64]
    so.paged_decode_f32.restype, so.write_kv_f32.restype = None, i64
    return so.paged_decode_f32, so.write_kv_f32


try:  # NOTE: at import: any failure is an ImportError, as for a missing triton
    _decode_f32, _write_kv_f32 = _build()
except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache, a bad library
    raise ImportError(f"the cpu attention backend cannot be built here: {e}") from e


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as the torch backend's; float32 rows are copied in one C call."""
    if (k_scale is None and v_scale is None
            and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and key.stride()[1:] == value.stride()[1:] == (key.shape[2], 1)
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        width = key.shape[1] * key.shape[2]
        bad = _write_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.numel() // width,
                            slot_mapping.data_ptr(), key.shape[0], width)
        if bad:
            raise IndexError(f"{bad} KV cache slots out of range")
        return
    torch_backend.write_kv(key, value, k_cache, v_cache, slot_mapping,
                           k_scale=k_scale, v_scale=v_scale)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as the torch backend's; decodes run in C where `fits` says they can."""
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decodes
    if nd and fits(q, k_cache, v_cache, out, k_scale, v_scale, meta):
        decode(q[:nd], k_cache, v_cache, meta, scale, out[:nd])
    elif nd:
        out[:nd] = torch_backend.decode(q[:nd], k_cache, v_cache, meta, scale, (k_scale, v_scale))
    torch_backend.prefills(q, k_cache, v_cache, meta, scale, (k_scale, v_scale), out)
    return out


def fits(q, k_cache, v_cache, out, k_scale, v_scale, meta) -> bool:
    """float32 everywhere, no FP8 scales, layouts the kernel indexes, sizes its arrays hold."""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    return (q.device.type == "cpu" and k_scale is None and v_scale is None
            and q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.stride()[1:] == (head_dim, 1) and out.stride()[1:] == (head_dim, 1)
            and meta.block_tables.dtype == torch.int64 and meta.block_tables.stride(1) == 1
            and meta.seq_lens.dtype == torch.int32 and meta.seq_lens.is_contiguous()
            and group <= MAX_GROUP and block_size <= MAX_BLOCK and group * head_dim <= MAX_ROWS)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, out: torch.Tensor,
           num_threads: int | None = None) -> None:
    """Decodes (one query token per sequence, the first len(q) sequences) into `out`.

    Each sequence's blocks are split across threads when the sequences give fewer than two
    tasks per thread and the sequence has 64+ blocks.
    """
    nd, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = meta.block_tables
    _decode_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(),
                out.data_ptr(), out.stride(0), nd, heads, kv_heads, head_dim, block_size,
                scale, num_threads or torch.get_num_threads())
