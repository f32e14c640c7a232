"""HF transformers loading a GGUF file (the reference of the parity tests) through the `gguf`
package's reader over an in-memory copy of the file instead of np.memmap. NOTE: memmap's
per-slice overhead was 31 of the 43 s HF took to load Gemma 3 270M (2.1 million slices, most of
them its 262k-token vocabulary); a plain array of the same bytes gives the same fields and
tensors, read by the same code."""

from __future__ import annotations

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
    from gguf import gguf_reader

    saved, gguf_reader.np = gguf_reader.np, _NumpyReadingWholeFiles()
    try:
        yield
    finally:
        gguf_reader.np = saved


def hf_from_gguf(path, **kwargs):
    """AutoModelForCausalLM.from_pretrained of a GGUF file, its reader over memory."""
    from transformers import AutoModelForCausalLM

    with gguf_in_memory():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
