"""Where a model load's packed tiles go: into a WeightArena (engine/allocator.py), packed from
their raw blocks, or, when an earlier load of the same GGUF by the same CPU library build left
them in a tiles file beside the GGUF's other derived files, mapped from that file.

NOTE: with its 96 MB of tiles packed, the bundled model's load took 0.32-0.39 s in the engine
process on this project's CPU machine, most of it first touches of fresh 2 MiB pages (3-5 ms each
in that virtual machine); with them mapped from the page cache, 0.10-0.13 s. ext4's large folios
map the file 2 MiB at a time (FilePmdMapped), as the arena's huge pages are, and decode steps
over them took 1.00x the time. The mapping is private copy-on-write and never written. One tiles
file per model: saving one removes that model's files of other builds.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path

import torch

from engine.allocator import HUGE_PAGE, WeightArena
from kernels.cpu import library
from kernels.cpu import quant as cpu_quant

log = logging.getLogger(__name__)
MAGIC = b"PSTILES1"
_HEAD = struct.Struct("<8sQ")  # magic, bytes of the JSON index that follows
_ALIGN = 64
# NOTE: below this a load packs in milliseconds: a file would only add clutter (a test's tiny
# models)
MIN_CACHED_BYTES = 16 << 20


class TileStore:
    """Hands out each packable weight's tiles in load order (`pack`): the next entry of the
    tiles file at `path` while its entries match what the load asks for, else packed into
    `arena`. `save` writes a load that packed any itself to `path`, for the next one (a file
    that stopped matching is rewritten so)."""

    def __init__(self, path: Path | None = None, arena: WeightArena | None = None,
                 min_bytes: int = MIN_CACHED_BYTES) -> None:
        self.path, self.min_bytes = path, min_bytes
        self.arena = arena or WeightArena()
        self.mapped = self.packed = 0  # tiles handed out from the file, and packed here
        self._entries: list[list[int]] = []  # [offset, nbytes, type, rows, cols, fingerprint]
        self._file: torch.Tensor | None = None
        self._tiles: list[tuple[list[int], torch.Tensor]] = []  # [type, rows, cols, print], tiles
        if path is not None and path.is_file():
            self._open(path)

    def pack(self, blocks: torch.Tensor, type_id: int, rows: int, cols: int) -> torch.Tensor:
        """The packed tiles of raw blocks [rows, row_bytes] of this type (cpu_quant.pack's)."""
        nbytes = cpu_quant.packed_bytes(type_id, rows, cols)
        # NOTE: the fingerprint only matters for a file (read or written)
        shape = [type_id, rows, cols, 0 if self.path is None else _fingerprint(blocks)]
        if self._file is not None and self.mapped < len(self._entries):
            offset, size, *saved = self._entries[self.mapped]
            if [size, *saved] == [nbytes, *shape]:
                self.mapped += 1
                return self._keep(shape, self._file[offset : offset + size])
            log.warning("%s does not match this load from its entry %d on; packing the rest",
                        self.path, self.mapped)
            self._file, self._entries = None, []
        self.packed += 1
        return self._keep(shape, cpu_quant.pack(blocks, type_id, cols,
                                                out=self.arena.empty(nbytes)))

    def save(self) -> None:
        """Write this load's tiles to `path` (atomically) where it packed any of them and they
        are worth a file; a failure to write is logged, the load is not affected."""
        total = sum(t.numel() for _, t in self._tiles)
        if self.path is None or not self.packed or total < self.min_bytes:
            return
        try:
            _write(self.path, self._tiles)
        except OSError as exc:
            log.warning("packed tiles not saved to %s: %s", self.path, exc)

    def _keep(self, shape: list[int], tiles: torch.Tensor) -> torch.Tensor:
        self._tiles.append((shape, tiles))
        return tiles

    def _open(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                magic, size = _HEAD.unpack(f.read(_HEAD.size))
                index = json.loads(f.read(size)) if magic == MAGIC else None
                region = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, struct.error) as exc:
            log.warning("%s is unreadable (%s); packing instead", path, exc)
            return
        entries = index.get("entries") if isinstance(index, dict) else None
        if not (isinstance(entries, list) and all(
                isinstance(e, list) and len(e) == 6 and all(type(x) is int for x in e)
                and e[0] % _ALIGN == 0 and 0 <= e[0] <= e[0] + e[1] <= len(region)
                for e in entries)):
            log.warning("%s is not a whole tiles file; packing instead", path)
            return
        self._file, self._entries = torch.frombuffer(region, dtype=torch.uint8), entries


def model_store(cache_dir: Path) -> TileStore:
    """The store of one GGUF's load: its tiles file in `cache_dir` (the source's), named for
    this CPU library build."""
    return TileStore(cache_dir / f"tiles-{library.build_id()}.bin")


def _fingerprint(blocks: torch.Tensor) -> int:
    """CRC-32 of a weight's first, middle and last rows of raw blocks: an entry is mapped only
    for the same weight (two of one shape, their order swapped by a change in the loader, are
    told apart), and this reads three rows of the GGUF, not the whole weight."""
    rows = blocks.shape[0]
    picked = blocks[[0, rows // 2, rows - 1]].numpy()
    return zlib.crc32(picked.tobytes())


def _write(path: Path, packed: list[tuple[list[int], torch.Tensor]]) -> None:
    # NOTE: the data starts on a 2 MiB boundary of the file (so its folios map 2 MiB at a
    # time); room for the index with every offset up to 20 digits
    sizes = [-(-tiles.numel() // _ALIGN) * _ALIGN for _, tiles in packed]
    room = _HEAD.size + len(json.dumps({"entries": [[0, t.numel(), *s] for s, t in packed]}))
    start = -(-(room + 20 * len(packed)) // HUGE_PAGE) * HUGE_PAGE
    offsets = [start + before for before in itertools.accumulate([0, *sizes[:-1]])]
    entries = [[o, t.numel(), *s] for o, (s, t) in zip(offsets, packed, strict=True)]
    index = json.dumps({"entries": entries}).encode()
    assert _HEAD.size + len(index) <= start
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tiles-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEAD.pack(MAGIC, len(index)) + index)
            for (offset, *_), (_, tiles) in zip(entries, packed, strict=True):
                f.seek(offset)
                f.write(tiles.numpy())
        os.replace(tmp, path)  # NOTE: atomic: a concurrent load sees the old file or the new
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in path.parent.glob("tiles-*.bin"):
        if old != path:
            old.unlink(missing_ok=True)
