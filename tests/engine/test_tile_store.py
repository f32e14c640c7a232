"""engine/models/tile_store.py: packed tiles saved by one load and mapped by the next, checked
against kernels/cpu/quant.py's own packing; a file that does not match, or is broken, is
packed over and rewritten; the engine's GGUF load uses it (or not, with packed_tile_cache off)."""

from __future__ import annotations

from pathlib import Path

import c_build
import numpy as np
import pytest
import torch

from engine.models.tile_store import MAGIC, TileStore
from kernels.cpu import quant as cpu_quant
from kernels.cpu.ggml_types import Q4_1, Q8_0


@pytest.fixture(autouse=True)
def _packing_cpu():
    c_build.require(None if cpu_quant.available() else cpu_quant.build_error())
    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))


def _weights(seed: int = 0) -> list[tuple[torch.Tensor, int, int, int]]:
    """Raw blocks of a few matrices (rows not all whole tiles): (blocks, type, rows, cols)."""
    rng = np.random.default_rng(seed)
    out = []
    for type_id, rows, cols in ((Q4_1, 40, 64), (Q8_0, 16, 96), (Q4_1, 7, 32)):
        blocks = rng.integers(0, 256, (rows, cpu_quant.row_bytes(type_id, cols)), np.uint8)
        if type_id == Q8_0:  # NOTE: finite fp16 scales: bytes 0-1 of each 34-byte block
            blocks.reshape(rows, -1, 34)[..., 1] &= 0x3B
        else:  # NOTE: d and m of each 20-byte block
            blocks.reshape(rows, -1, 20)[..., 1] &= 0x3B
            blocks.reshape(rows, -1, 20)[..., 3] &= 0x3B
        out.append((torch.from_numpy(blocks), type_id, rows, cols))
    return out


def _pack_all(store: TileStore, weights) -> list[torch.Tensor]:
    return [store.pack(b, t, r, c) for b, t, r, c in weights]


def _no_packing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("packed instead of mapped")

    monkeypatch.setattr(cpu_quant, "pack", refuse)


def test_a_saved_load_is_mapped_by_the_next_byte_for_byte(tmp_path, monkeypatch):
    weights = _weights()
    expected = [cpu_quant.pack(b, t, c) for b, t, _, c in weights]
    path = tmp_path / "tiles-build.bin"
    first = TileStore(path, min_bytes=0)
    assert all(torch.equal(a, b) for a, b in zip(_pack_all(first, weights), expected,
                                                 strict=True))
    first.save()
    assert (first.packed, first.mapped) == (3, 0) and path.read_bytes()[:8] == MAGIC
    _no_packing(monkeypatch)
    second = TileStore(path, min_bytes=0)
    mapped = _pack_all(second, weights)
    assert (second.packed, second.mapped) == (0, 3)
    assert all(torch.equal(a, b) for a, b in zip(mapped, expected, strict=True))
    assert all(t.data_ptr() % 64 == 0 for t in mapped)
    second.save()  # NOTE: nothing packed: the file stays as it was
    assert path.stat().st_size > 0


def test_a_file_that_stops_matching_is_packed_from_there_on_and_rewritten(tmp_path):
    weights = _weights()
    path = tmp_path / "tiles-build.bin"
    store = TileStore(path, min_bytes=0)
    _pack_all(store, weights)
    store.save()
    changed = [*weights[:2], _weights(seed=1)[0]]  # NOTE: the third entry's shape differs
    again = TileStore(path, min_bytes=0)
    tiles = _pack_all(again, changed)
    assert (again.mapped, again.packed) == (2, 1)
    expected = [cpu_quant.pack(b, t, c) for b, t, _, c in changed]
    assert all(torch.equal(a, b) for a, b in zip(tiles, expected, strict=True))
    again.save()
    third = TileStore(path, min_bytes=0)
    assert all(torch.equal(a, b) for a, b in zip(_pack_all(third, changed), expected,
                                                 strict=True))
    assert (third.mapped, third.packed) == (3, 0)


def test_two_weights_of_one_shape_in_swapped_order_are_not_mapped_onto_each_other(tmp_path):
    """Entries match by their raw blocks' fingerprint too: a loader that came to pack the same
    shapes in another order gets each weight's own tiles."""
    a, b = _weights(seed=2)[0], _weights(seed=3)[0]  # NOTE: one shape, other contents
    path = tmp_path / "tiles-build.bin"
    store = TileStore(path, min_bytes=0)
    _pack_all(store, [a, b])
    store.save()
    swapped = TileStore(path, min_bytes=0)
    tiles = _pack_all(swapped, [b, a])
    assert (swapped.mapped, swapped.packed) == (0, 2)
    assert torch.equal(tiles[0], cpu_quant.pack(b[0], b[1], b[3]))
    assert torch.equal(tiles[1], cpu_quant.pack(a[0], a[1], a[3]))


@pytest.mark.parametrize("damage", ["truncated", "magic", "index", "entry"])
def test_a_broken_file_is_packed_over_and_repaired(tmp_path, damage, caplog):
    weights = _weights()
    path = tmp_path / "tiles-build.bin"
    store = TileStore(path, min_bytes=0)
    _pack_all(store, weights)
    store.save()
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "magic":
        data[:8] = b"NOTTILES"
    elif damage == "index":
        data[16:20] = b"}{]["
    else:  # NOTE: an offset that is not a whole number
        data = data.replace(b"[2097152,", b"[2097152.5,", 1)
    path.write_bytes(bytes(data))
    broken = TileStore(path, min_bytes=0)
    expected = [cpu_quant.pack(b, t, c) for b, t, _, c in weights]
    assert all(torch.equal(a, b) for a, b in zip(_pack_all(broken, weights), expected,
                                                 strict=True))
    assert (broken.mapped, broken.packed) == (0, 3)
    assert "packing instead" in caplog.text
    broken.save()
    assert (lambda s: (_pack_all(s, weights), s.mapped)[1])(TileStore(path, min_bytes=0)) == 3


def test_saving_keeps_one_file_per_model_and_small_loads_none(tmp_path):
    weights = _weights()
    stale = tmp_path / "tiles-older-build.bin"
    stale.write_bytes(b"x")
    path = tmp_path / "tiles-build.bin"
    small = TileStore(path)  # NOTE: the default threshold: these few KB are not worth a file
    _pack_all(small, weights)
    small.save()
    assert not path.exists() and stale.exists()
    store = TileStore(path, min_bytes=0)
    _pack_all(store, weights)
    store.save()
    assert path.exists() and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiles-build.bin"]


def _tiles_mapping(address: int) -> str | None:
    """The file behind this process's mapping that holds `address` (/proc/self/smaps)."""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, *rest = line.split()
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                return rest[4] if len(rest) > 4 else None
    return None


def test_the_engine_maps_the_bundled_models_tiles_on_its_second_load(tmp_path, monkeypatch,
                                                                      bundled_tokenizer_dir):
    """The second load of the bundled GGUF (96 MB of tiles) maps every packed part from its
    tiles file, equal byte for byte to the first load's, with the same greedy tokens; with
    packed_tile_cache off nothing is written or read."""
    from engine import LLM
    from engine.models.quant_linear import QuantEmbedding, QuantLinear
    from ipc.sampling import SamplingParams

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))

    def load(cache: bool):
        llm = LLM(None, tokenizer=str(bundled_tokenizer_dir), quantization="gguf",
                  max_model_len=128, num_gpu_blocks=16, packed_tile_cache=cache)
        parts = [p for m in llm.engine.runner.model.modules()
                 for p in (m.parts if isinstance(m, QuantLinear) else
                           [m.weight_q] if isinstance(m, QuantEmbedding) else [])]
        out = llm.generate([{"prompt_token_ids": list(range(300, 340))}],
                           SamplingParams(temperature=0.0, max_tokens=8))
        return llm, parts, out[0].outputs[0].token_ids

    off, off_parts, off_tokens = load(False)
    assert not list(tmp_path.rglob("tiles-*.bin"))
    first, first_parts, first_tokens = load(True)
    files = list(tmp_path.rglob("tiles-*.bin"))
    assert len(files) == 1 and files[0].stat().st_size > 96 * 10**6
    assert not any(_tiles_mapping(p.data.data_ptr()) for p in first_parts)
    second, second_parts, second_tokens = load(True)
    assert all(_tiles_mapping(p.data.data_ptr()) == str(files[0])
               for p in second_parts if p.packed)
    assert sum(p.packed for p in second_parts) >= 4 * 30  # NOTE: 30 layers of 4 products
    for a, b, c in zip(off_parts, first_parts, second_parts, strict=True):
        assert torch.equal(a.data, b.data) and torch.equal(a.data, c.data)
    assert off_tokens == first_tokens == second_tokens


def test_a_draft_model_keeps_its_own_tiles_file(tmp_path, monkeypatch, bundled_tokenizer_dir):
    """--speculative-method draft loads its GGUF with the same packed_tile_cache: the bundled
    file as its own draft gets a second tiles file (its own cache directory), mapped the
    next time."""
    from engine import LLM
    from ipc.model_source import bundled_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))

    def load():
        return LLM(None, tokenizer=str(bundled_tokenizer_dir), quantization="gguf",
                   max_model_len=128, num_gpu_blocks=16, speculative_method="draft",
                   speculative_model=str(bundled_gguf()), num_speculative_tokens=2)

    load()
    files = sorted(tmp_path.rglob("tiles-*.bin"))
    assert len(files) == 2 and files[0].parent != files[1].parent
    draft = load().engine.runner.draft.model
    head = draft.lm_head.parts[0]
    assert head.packed and _tiles_mapping(head.data.data_ptr()) in map(str, files)
