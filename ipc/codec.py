"""msgpack codec for the wire: one reusable encoder, one typed decoder per direction.

Decoding validates against the tagged unions in ipc.messages; nothing here ever pickles.
"""

from __future__ import annotations

import msgspec

from ipc.messages import FromEngine, ToEngine

DecodeError = msgspec.DecodeError  # raised for malformed or ill-typed frames


class Encoder:
    """Encodes any message; `encode_into` reuses one buffer on the hot path.

    Not thread-safe: give each thread that sends its own Encoder.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray(4096)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def encode_into(self, msg: msgspec.Struct) -> bytearray:
        """Encode into the reused buffer and return it; valid until the next call."""
        # NOTE: the caller must send (zmq copies with copy=True) before encoding the next
        # message, and must not keep a memoryview of it: that would block the resize.
        self._encoder.encode_into(msg, self._buffer)
        return self._buffer


_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def decode_to_engine(data: bytes | memoryview) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes | memoryview) -> FromEngine:
    return _from_engine.decode(data)
