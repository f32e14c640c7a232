"""The records the driver writes to the workers' ring: an op name, small msgpack fields, and
tensors as raw bytes (dtype and shape in the header), never pickled.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import torch

from kernels import AttentionMetadata

_LEN = struct.Struct("<I")
_META_TENSORS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")


def encode(op: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    cpu = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
    header = msgspec.msgpack.encode({
        "op": op, "fields": fields,
        "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for k, t in cpu.items()],
    })
    parts = [_LEN.pack(len(header)), header]
    parts += [t.view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in cpu.values()]
    return b"".join(parts)


def decode(data: bytes, device: torch.device) -> tuple[str, dict[str, Any],
                                                       dict[str, torch.Tensor]]:
    (n,) = _LEN.unpack_from(data)
    header = msgspec.msgpack.decode(data[4 : 4 + n])
    offset, tensors = 4 + n, {}
    for key, dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        count = 1
        for dim in shape:
            count *= dim
        size = count * dtype.itemsize
        raw = bytearray(data[offset : offset + size])  # NOTE: writable, so no copy warning
        flat = torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        tensors[key] = flat.reshape(shape).to(device)
        offset += size
    return header["op"], header["fields"], tensors


def meta_to_wire(meta: AttentionMetadata) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    fields = {"num_decodes": meta.num_decodes, "query_lens_cpu": meta.query_lens_cpu,
              "seq_lens_cpu": meta.seq_lens_cpu, "max_decode_seq_len": meta.max_decode_seq_len}
    return fields, {k: getattr(meta, k) for k in _META_TENSORS}


def meta_from_wire(fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> AttentionMetadata:
    return AttentionMetadata(
        **{k: tensors[k] for k in _META_TENSORS},
        num_decodes=fields["num_decodes"], query_lens_cpu=fields["query_lens_cpu"],
        seq_lens_cpu=fields["seq_lens_cpu"], max_decode_seq_len=fields["max_decode_seq_len"])
