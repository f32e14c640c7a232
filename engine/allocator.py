"""Host memory for a CPU engine: glibc malloc settings that keep activation buffers in the heap
between steps, and zeroed storage (the KV pool) that is committed only as it is written.

torch allocates CPU tensors with plain malloc. By default glibc serves blocks over 128 KiB with
a fresh mmap (its threshold only rises after the first such block is freed) and returns freed
heap top to the kernel past 128 KiB, so a step's activations page-fault in again: the first
2,048-token prefill of the bundled model took 3.0 s instead of 2.1 s, most of the gap system time.
Applied after loading: weights then keep their own mappings, and the checkpoint copies that
packing frees go back to the kernel instead of staying in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import mmap
import os
import sys
from pathlib import Path

import torch

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks above it are still mmapped
TRIM_THRESHOLD = 512 << 20  # free heap top kept for the next step before it is returned
TOP_PAD = 64 << 20  # each heap extension asks the kernel for this much more
# NOTE: glibc reads these at start; when the operator set any, theirs stand.
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # NOTE: musl and other libcs have no mallopt / malloc_trim (AttributeError)
        libc.mallopt.restype, libc.malloc_trim.restype = ctypes.c_int, ctypes.c_int
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def release_freed_heap() -> None:
    """Give heap that is free (a checkpoint's parse, unpacked copies) back to the kernel.
    NOTE: glibc keeps freed memory below the heap top resident: 40 MB on SmolLM2's GGUF load."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def tune_malloc() -> bool:
    """Return what loading freed to the kernel, then apply the settings above (call it once
    the weights are loaded and packed); False (and nothing set) off glibc or when the env
    sets any."""
    if any(k in os.environ for k in ENV):
        return False
    libc = _libc()
    if libc is None:
        return False
    release_freed_heap()
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64


class WeightArena:
    """Buffers for weights that live as long as their model (packed tiles), carved one after
    another from anonymous mappings of `chunk` bytes aligned to 2 MiB, with transparent huge
    pages asked for (MADV_HUGEPAGE: the kernel decides; its "never" leaves 4 KiB pages).

    NOTE: a decode step streams every weight from DRAM, and 4 KiB pages cost it: in 2 MiB
    pages the 1B-class Q4_K_M decoded at 27.2-28.0 against 28.8-29.4 ms/token, the bundled
    model at 4.07-4.76 against 4.28-4.85 (two copies of one model in one process, steps
    alternating; AVX-512 EPYC, 2026-12-04). A mapping goes when the last tensor on it does
    (frombuffer keeps a reference), so a model's weights leave with it; a chunk's unused tail
    is never touched, so never resident. Without MADV_HUGEPAGE (off Linux), torch.empty.
    """

    def __init__(self, chunk: int = 64 << 20) -> None:
        self.chunk = chunk
        self._free: torch.Tensor | None = None  # the current mapping's unused bytes

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised 1-D uint8 tensor of `nbytes`, 64-byte aligned."""
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // 64) * 64
        if self._free is None or self._free.numel() < size:
            self._free = _huge_mapping(max(self.chunk, -(-size // HUGE_PAGE) * HUGE_PAGE))
        out, self._free = self._free[:nbytes], self._free[size:]
        return out


def _huge_mapping(size: int) -> torch.Tensor:
    """`size` bytes (a multiple of 2 MiB) of a fresh private anonymous mapping, starting on a
    2 MiB boundary, huge pages asked for."""
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # NOTE: EINVAL from a kernel built without transparent huge pages
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + size]


def untouched_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` contiguous zero tensors of `shape` in one private anonymous mapping, none of
    whose pages is resident until written.

    NOTE: the kernel gives an untouched anonymous page as zeros (a read maps the shared zero
    page, which is not counted as resident), so every slot reads 0.0, never NaN, before its
    first write, and RSS grows with what is written instead of with the pool's size
    (torch.zeros writes every page at once).
    """
    per = dtype.itemsize * math.prod(shape)
    if count * per == 0:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    # NOTE: the mapping lives as long as any tensor on it (frombuffer keeps a reference)
    region = mmap.mmap(-1, count * per, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        # NOTE: 4 KiB commits where transparent huge pages are "always" (a 2 MiB page per
        # first write would commit most of a small pool at once), and a mapping of its own:
        # the kernel merges adjacent anonymous mappings of equal flags (malloc's), which would
        # hide the pool's line in /proc/self/smaps (resident_bytes)
        region.madvise(mmap.MADV_NOHUGEPAGE)
    flat = torch.frombuffer(region, dtype=torch.uint8).view(dtype)
    return list(flat.view(count, *shape).unbind(0))


def resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of the mapping that holds `tensor` (/proc/self/smaps; 0 off Linux)."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's header line: start-end ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    return 0
