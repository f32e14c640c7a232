"""Property tests of the ipc decoders and the engine's input path: random bytes and random
msgpack never raise anything but DecodeError, and the engine's socket reader drops bad frames
and keeps serving."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.codec import DecodeError, Encoder, decode_from_engine, decode_to_engine
from ipc.messages import AbortRequests, AddRequest, EngineReady
from ipc.sampling import SamplingParams
from ipc.transport import EngineSockets, GatewaySockets

pytestmark = pytest.mark.timeout(60)
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
        | st.text(max_size=8) | st.binary(max_size=8))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
TAGS = ["add", "abort", "shutdown", "ready", "outputs", "heartbeat", "dead", "bogus"]
FIELDS = ["request_id", "prompt_token_ids", "sampling", "priority", "arrival_time",
          "request_ids", "timeout", "deltas", "stats", "incarnation", "reason", "step"]
# NOTE: a tagged dict reaches the struct validators (sampling bounds, field types), not only
# the msgpack parser.
tagged = st.builds(lambda tag, fields: {"type": tag, **fields}, st.sampled_from(TAGS),
                   st.dictionaries(st.sampled_from(FIELDS), anything, max_size=5))
frames = (st.binary(max_size=200) | anything.map(msgspec.msgpack.encode)
          | tagged.map(msgspec.msgpack.encode))


@SETTINGS
@given(frames)
def test_decoders_raise_only_decode_error(data: bytes) -> None:
    for decode in (decode_to_engine, decode_from_engine):
        try:
            decode(data)
        except DecodeError:
            pass  # NOTE: the only failure allowed; the transport drops such frames


@SETTINGS
@given(frames, st.integers(0, 100))
def test_truncated_and_flipped_valid_frames(data: bytes, cut: int) -> None:
    valid = Encoder().encode(AddRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                        sampling=SamplingParams(max_tokens=4)))
    for mangled in (valid[: cut % len(valid)], valid[:cut % len(valid)] + data,
                    bytes(b ^ 0xFF if i == cut % len(valid) else b for i, b in enumerate(valid))):
        try:
            decode_to_engine(mangled)
        except DecodeError:
            pass


async def test_engine_input_drops_garbage_and_keeps_serving(tmp_path) -> None:
    gw = GatewaySockets(f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock")
    engine = EngineSockets(gw.input_addr, gw.output_addr, "fuzz")
    try:
        engine.send_handshake(EngineReady(model="m", max_model_len=8, block_size=16,
                                          num_gpu_blocks=1, incarnation="fuzz"))
        identity, _ = await asyncio.wait_for(gw.recv_handshake(), 10)
        garbage = [b"", b"\xc1", b"\x92\x01", msgspec.msgpack.encode({"type": "add"}),
                   msgspec.msgpack.encode({"type": "add", "request_id": 5}), bytes(range(256))]
        for payload in garbage:
            gw._router.send_multipart([identity, payload])
        gw.send(identity, AbortRequests(request_ids=["after"]))
        got = [await asyncio.to_thread(engine.recv_input, 2000) for _ in range(len(garbage) + 1)]
        assert got[:-1] == [None] * len(garbage)
        assert got[-1] == AbortRequests(request_ids=["after"])
    finally:
        engine.close(linger_ms=0)
        gw.close()
