"""A GGUF file's metadata and tensors, read from its header in one pass (GGUF v2 and v3).

The `gguf` package's GGUFReader builds numpy views for every element of every array field:
on SmolLM2-135M (49152 tokenizer tokens, 48900 merges) that is 1.8-2.9 s of the engine's
3.7-4.1 s to ready. This reader decodes the header with `struct` straight into Python values
(about 0.1 s there) and maps the tensors as read-only numpy views of the file, with the
dtype and shape rules of GGUFReader (float types as their numpy dtype, block types as uint8
rows of bytes), so the loader treats both alike. tests/engine/test_gguf_file.py checks it
against GGUFReader field by field and tensor by tensor.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# NOTE: ggml's tensor types, as the `gguf` package's GGMLQuantizationType and GGML_QUANT_SIZES
# have them (tests/engine/test_gguf_file.py keeps the two equal): reading a file imports no
# `gguf`, whose __init__ imports gguf.vocab, which imports mistral_common and sentencepiece
# where they are installed: 0.49 s in process (`LLM`) beside the test extra, 0.04-0.1 s in
# an engine process, which marks mistral_common absent (engine/__main__.py) (2026-12-03).
_TYPES = {  # id: (name, values per block, bytes per block)
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
GGMLType = enum.IntEnum("GGMLType", {name: i for i, (name, _, _) in _TYPES.items()})
BLOCK_SIZES = {GGMLType(i): (elems, size) for i, (_, elems, size) in _TYPES.items()}

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of one value (8 string, 9 array: read by hand)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")  # a string's length
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# tensor types GGUFReader gives their own numpy dtype; every other type is uint8 bytes
_PLAIN = {GGMLType.F16: np.float16, GGMLType.F32: np.float32, GGMLType.F64: np.float64,
          GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.I32: np.int32,
          GGMLType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]  # ggml order: shape[0] is the innermost (row) length
    data: np.ndarray  # numpy order (reversed shape); block types: [..., bytes per row] uint8


class GGUFFile:
    """fields: key -> value (int, float, bool, str, or a list of them); tensors in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._read()
        except (struct.error, ValueError) as e:  # NOTE: short reads, views past the end
            if str(e).startswith(str(self.path)):
                raise
            raise ValueError(f"{self.path}: a truncated or corrupt GGUF file ({e})") from e

    def _read(self) -> None:
        self._map = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._map)
        self._pos = len(MAGIC)
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.version = version = self._unpack("<I")
        if version not in (2, 3):
            # NOTE: a big-endian file reads as a huge version number here
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3, "
                             "little-endian)")
        num_tensors, num_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, kind, start + offset)
                        for name, dims, kind, offset in infos]

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = str(self._buf[self._pos : self._pos + n], "utf-8")
        self._pos += n
        return s

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary: 49152-262144 of them) in one tight loop: the
        whole header of the bundled model's file in 0.044 s, of Gemma 3 270M's in 0.127,
        against 0.067 and 0.185 string by string."""
        buf, pos, out = self._buf, self._pos, []
        length = _U64.unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item == _STRING:
            return self._strings(count)
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            values = np.frombuffer(self._buf, dtype, count, self._pos).tolist()
            self._pos += count * dtype.itemsize
            return values
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        if kind not in _TYPES:
            raise ValueError(f"{self.path}: tensor {name} has the unknown ggml type {kind}")
        tensor_type = GGMLType(kind)
        shape = tuple(reversed(dims))
        n = int(np.prod(dims))
        if tensor_type in _PLAIN:
            data = np.frombuffer(self._map, _PLAIN[tensor_type], n, offset).reshape(shape)
        else:
            block, size = BLOCK_SIZES[tensor_type]
            if dims[0] % block:
                raise ValueError(f"{self.path}: tensor {name} rows of {dims[0]} values are "
                                 f"not whole {tensor_type.name} blocks of {block}")
            row_bytes = dims[0] // block * size
            data = np.frombuffer(self._map, np.uint8, n // block * size, offset).reshape(
                *shape[:-1], row_bytes)
        return GGUFTensor(name, tensor_type, dims, data)
