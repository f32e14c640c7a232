"""HF transformers loading a GGUF file (the reference of the parity tests) through the `gguf`
package's reader over an in-memory copy of the file instead of np.memmap. NOTE: memmap's
per-slice overhead was 31 of the 43 s HF took to load Gemma 3 270M (2.1 million slices, most of
them its 262k-token vocabulary); a plain array of the same bytes gives the same fields and
tensors, read by the same code. transformers builds the reader twice per load (once for the
config, once for the weights); inside `gguf_in_memory` the second build of a path reuses the
first reader, whose fields and tensors are read-only views; and it builds gguf's tensor-name
map once per module of the model (397 times, 10 s, for the bundled model), which is the same
read-only map for one architecture and layer count, so that is built once too."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


class _NumpyReadingWholeFiles:
    """numpy, whose memmap(path) is the file's bytes read into memory."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode: str = "r") -> np.ndarray:
        assert mode == "r", mode  # NOTE: the reader only reads here
        return np.fromfile(path, dtype=np.uint8)


@contextmanager
def gguf_in_memory() -> Iterator[None]:
    import gguf
    from gguf import gguf_reader

    built: dict[tuple[str, str], gguf_reader.GGUFReader] = {}
    plain_reader = gguf.GGUFReader

    def reader_once_per_path(path, mode: str = "r") -> gguf_reader.GGUFReader:
        key = (str(path), mode)
        if key not in built:
            built[key] = plain_reader(path, mode)
        return built[key]

    plain_name_map = gguf.get_tensor_name_map
    name_map_once = functools.cache(plain_name_map)

    saved_np, gguf_reader.np = gguf_reader.np, _NumpyReadingWholeFiles()
    # NOTE: transformers imports both from `gguf` at each call, so these stand in for them
    gguf.GGUFReader, gguf.get_tensor_name_map = reader_once_per_path, name_map_once
    try:
        yield
    finally:
        gguf_reader.np, gguf.GGUFReader = saved_np, plain_reader
        gguf.get_tensor_name_map = plain_name_map


def hf_from_gguf(path, **kwargs):
    """AutoModelForCausalLM.from_pretrained of a GGUF file, its reader over memory."""
    from transformers import AutoModelForCausalLM

    with gguf_in_memory():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
