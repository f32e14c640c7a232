"""What rank 0 sends the other ranks on the channel, one record per runner call: msgspec
tagged structs in msgpack (never pickled). A step's record is its StepPlan, nothing else.
"""

from __future__ import annotations

import msgspec

from engine.step_plan import StepPlan


class RunnerInit(msgspec.Struct, tag="init", frozen=True):
    """Build the rank's ModelRunner with rank 0's sizes (the KV pool is sized on rank 0)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    attention_backend: str  # the backend that runs on rank 0 (auto resolved)
    kv_dtype: str  # a torch dtype name: float32, bfloat16, float8_e4m3fn, ...
    num_cpu_blocks: int
    draft_layers: int | None  # the self draft's layers (the target's first ones)
    seed: int  # the sampler's generator for requests without a seed, as on rank 0
    batch_invariant: bool = False  # AttentionMetadata.invariant, as on rank 0


class Propose(msgspec.Struct, tag="propose"):
    plan: StepPlan  # ModelRunner.propose(plan): the self draft's phase of a step


class Execute(msgspec.Struct, tag="execute"):
    plan: StepPlan  # ModelRunner.execute(plan), drafts attached


class Stop(msgspec.Struct, tag="stop"):
    pass


Record = RunnerInit | Propose | Execute | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def decode(data: bytes) -> Record:
    return _decoder.decode(data)
