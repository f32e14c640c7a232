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

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of one value (8 string, 9 array: read by hand)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# tensor types GGUFReader gives their own numpy dtype; every other type is uint8 bytes
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
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

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
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
        tensor_type = GGMLQuantizationType(kind)
        shape = tuple(reversed(dims))
        n = int(np.prod(dims))
        if tensor_type in _PLAIN:
            data = np.frombuffer(self._map, _PLAIN[tensor_type], n, offset).reshape(shape)
        else:
            block, size = GGML_QUANT_SIZES[tensor_type]
            if dims[0] % block:
                raise ValueError(f"{self.path}: tensor {name} rows of {dims[0]} values are "
                                 f"not whole {tensor_type.name} blocks of {block}")
            row_bytes = dims[0] // block * size
            data = np.frombuffer(self._map, np.uint8, n // block * size, offset).reshape(
                *shape[:-1], row_bytes)
        return GGUFTensor(name, tensor_type, dims, data)
