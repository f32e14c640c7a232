"""The one CPU library's tables: the GGML type table in C and in Python against the `gguf`
package; every C source in the build list and every exported prototype declared for ctypes;
a changed header (not only a source) rebuilds the library."""

from __future__ import annotations

import re
from pathlib import Path

import c_build
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels import cc_build
from kernels.cpu import ggml_types, library


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if library.available() else library.build_error())


def test_ggml_type_table_matches_gguf_in_python_and_c() -> None:
    lib = library.load()
    for type_id, (elems, nbytes) in ggml_types.BLOCKS.items():
        gguf_type = GGMLQuantizationType(type_id)
        assert ggml_types.TYPE_NAMES[type_id] == gguf_type.name
        assert GGML_QUANT_SIZES[gguf_type] == (elems, nbytes)
        assert getattr(ggml_types, gguf_type.name) == type_id
    for type_id in range(64):  # C knows exactly the Python table's types
        want = ggml_types.BLOCKS.get(type_id, (0, 0))
        assert (lib.quant_block_elems(type_id), lib.quant_block_bytes(type_id)) == want, type_id
    assert set(ggml_types.PACKED_TYPES) <= set(ggml_types.BLOCKS)


def test_every_source_is_built_and_every_entry_point_declared() -> None:
    on_disk = {p.name for p in library.CSRC.glob("*.c")}
    assert on_disk == {name for name, _ in library.SOURCES}
    assert set(library.HEADERS) == set(library.CSRC.glob("*.h"))
    api = (library.CSRC / "api.h").read_text() + (library.CSRC / "fused.c").read_text()
    exported = set(re.findall(r"^(?:int64_t|int|void)\s+\*?(\w+)\(", api, flags=re.M))
    assert "fused_decode_stack" in exported and "quant_mlp_packed" in exported
    assert exported == set(library.SIGNATURES)
    lib = library.load()
    for name in exported:
        getattr(lib, name)  # the symbol is in the built library (AttributeError otherwise)


def test_the_cache_key_covers_sources_headers_and_flags(tmp_path: Path) -> None:
    src, header = tmp_path / "a.c", tmp_path / "a.h"
    src.write_text('#include "a.h"\nint f(void) { return A; }\n')
    header.write_text("#define A 1\n")
    key = cc_build._key([(src, ["-O2"])], [header], "cc 1")
    assert key == cc_build._key([(src, ["-O2"])], [header], "cc 1")
    assert key != cc_build._key([(src, ["-O3"])], [header], "cc 1")
    assert key != cc_build._key([(src, ["-O2"])], [header], "cc 2")
    header.write_text("#define A 2\n")
    assert key != cc_build._key([(src, ["-O2"])], [header], "cc 1")
