"""The wire codec: every message round-trips, newer peers' extra fields are tolerated, no pickle."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec
import pytest

from ipc import codec
from ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    EngineStats,
    Heartbeat,
    PositionLogprobs,
    Shutdown,
    StepOutputs,
    TokenDelta,
    TokenLogprob,
)
from ipc.sampling import SamplingParams

STATS = EngineStats(step=7, num_running=2, kv_blocks_total=64, kv_blocks_free=60)

TO_ENGINE = [
    AddRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(temperature=0.0, max_tokens=5, stop=("x",), seed=3),
        priority=-1,
        arrival_time=12.5,
    ),
    AddRequest(request_id="r2", prompt_token_ids=[9], sampling=SamplingParams()),
    AbortRequests(request_ids=["r1", "r2"]),
    Shutdown(timeout=3.0),
    Shutdown(),
]

FROM_ENGINE = [
    EngineReady(
        model="m", max_model_len=2048, block_size=16, num_gpu_blocks=100, num_cpu_blocks=4,
        incarnation="abc", eos_token_ids=[2], tokenizer="/tmp/tok",
    ),
    StepOutputs(
        deltas=[
            TokenDelta(request_id="r1", new_token_ids=[5, 6], num_prompt_tokens=3),
            TokenDelta(request_id="r2", finish_reason="error", error="too long"),
            TokenDelta(
                request_id="r3", new_token_ids=[7], finish_reason="stop", stop_reason=2,
                logprobs=[PositionLogprobs(7, -0.5, 1, [TokenLogprob(7, -0.5)])],
            ),
        ],
        stats=STATS,
        incarnation="abc",
    ),
    Heartbeat(step=3, queue_depth=1, stats=STATS, incarnation="abc"),
    EngineDead(reason="boom", incarnation="abc"),
]


@pytest.mark.parametrize("msg", TO_ENGINE, ids=lambda m: type(m).__name__)
def test_to_engine_round_trip(msg: msgspec.Struct) -> None:
    enc = codec.Encoder()
    assert codec.decode_to_engine(enc.encode(msg)) == msg
    assert codec.decode_to_engine(enc.encode_into(msg)) == msg


@pytest.mark.parametrize("msg", FROM_ENGINE, ids=lambda m: type(m).__name__)
def test_from_engine_round_trip(msg: msgspec.Struct) -> None:
    enc = codec.Encoder()
    assert codec.decode_from_engine(enc.encode(msg)) == msg
    assert codec.decode_from_engine(enc.encode_into(msg)) == msg


def test_encode_into_reuses_one_buffer_across_sizes() -> None:
    enc = codec.Encoder()
    deltas = [TokenDelta(request_id=f"r{i}", new_token_ids=[i]) for i in range(2000)]
    big = StepOutputs(deltas=deltas)
    small = Heartbeat(step=1, queue_depth=0)
    first = enc.encode_into(big)
    assert codec.decode_from_engine(first) == big
    second = enc.encode_into(small)
    assert second is first  # the same bytearray, shrunk to the new message
    assert codec.decode_from_engine(second) == small


def test_direction_is_checked() -> None:
    enc = codec.Encoder()
    with pytest.raises(codec.DecodeError):
        codec.decode_to_engine(enc.encode(Heartbeat(step=1, queue_depth=0)))
    with pytest.raises(codec.DecodeError):
        codec.decode_from_engine(enc.encode(Shutdown()))


def test_invalid_sampling_on_the_wire_is_a_decode_error() -> None:
    raw = msgspec.msgpack.encode(
        {"type": "add", "request_id": "r", "prompt_token_ids": [1],
         "sampling": {"temperature": -1.0}}
    )
    with pytest.raises(codec.DecodeError, match="temperature"):
        codec.decode_to_engine(raw)


# ---- append-only evolution: a newer peer adds fields last, an older one still decodes ------


class _NewerHeartbeat(msgspec.Struct, tag_field="type", tag="heartbeat", kw_only=True):
    step: int
    queue_depth: int
    stats: EngineStats | None = None
    incarnation: str = ""
    gpu_temperature: float = 0.0  # a field this build does not know


class _NewerAdd(msgspec.Struct, tag_field="type", tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, object]
    priority: int = 0
    arrival_time: float = 0.0
    lora: str = "adapter-1"


def test_unknown_fields_from_a_newer_engine_are_ignored() -> None:
    raw = msgspec.msgpack.encode(_NewerHeartbeat(step=4, queue_depth=2, incarnation="x",
                                                 gpu_temperature=71.5))
    assert codec.decode_from_engine(raw) == Heartbeat(step=4, queue_depth=2, incarnation="x")


def test_unknown_fields_from_a_newer_gateway_are_ignored() -> None:
    raw = msgspec.msgpack.encode(
        _NewerAdd(request_id="r", prompt_token_ids=[1], sampling={"top_k": 5, "new_knob": 1})
    )
    msg = codec.decode_to_engine(raw)
    assert msg == AddRequest(request_id="r", prompt_token_ids=[1],
                             sampling=SamplingParams(top_k=5))


def test_missing_defaulted_fields_from_an_older_peer_decode() -> None:
    raw = msgspec.msgpack.encode({"type": "outputs", "deltas": [{"request_id": "r"}]})
    assert codec.decode_from_engine(raw) == StepOutputs(deltas=[TokenDelta(request_id="r")])


# ---- no pickle ----------------------------------------------------------------------------


def test_pickle_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def _forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the wire")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, _forbidden)
    enc = codec.Encoder()
    for msg in TO_ENGINE:
        assert codec.decode_to_engine(enc.encode_into(msg)) == msg
    for msg in FROM_ENGINE:
        assert codec.decode_from_engine(enc.encode_into(msg)) == msg


def test_a_pickled_frame_is_rejected() -> None:
    with pytest.raises(codec.DecodeError):
        codec.decode_to_engine(pickle.dumps(Shutdown(timeout=1.0)))


def test_ipc_sources_never_pickle() -> None:
    root = Path(codec.__file__).parent
    for name in ("codec.py", "transport.py", "messages.py"):
        text = (root / name).read_text()
        # NOTE: zmq's send_pyobj/recv_pyobj pickle under the hood.
        for needle in ("import pickle", "from pickle", "_pyobj", "marshal"):
            assert needle not in text, (name, needle)
