"""Messages between gateway and engine, as msgspec tagged unions (append-only evolution).

New fields go last and carry defaults, so an older peer still decodes a newer message.
"""

from __future__ import annotations

import msgspec

from ipc.config import EngineConfig
from ipc.pooling import PoolingInfo
from ipc.sampling import SamplingParams

# Terminal finish reasons. Every request gets exactly one TokenDelta whose finish_reason is set.
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context length
FINISH_ABORT = "abort"  # cancelled by the client or the gateway
FINISH_ERROR = "error"  # rejected or failed; `error` says why

# Upper bounds (seconds) of the grammar compile-time histogram in EngineStats.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


class _Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    pass


# ---- gateway -> engine -----------------------------------------------------------------


class AddRequest(_Msg, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower runs first (as in vLLM)
    arrival_time: float = 0.0  # time.time() at the gateway
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


class AbortRequests(_Msg, tag="abort"):
    request_ids: list[str]
    index: int | None = None  # only this choice of each (n > 1: it matched a stop string)


class Shutdown(_Msg, tag="shutdown"):
    """Stop admitting, finish in-flight work up to `timeout` seconds, abort the rest, exit."""

    timeout: float = 0.0


class LoadLoraAdapter(_Msg, tag="load_lora"):
    """Read the PEFT directory `lora_path` as adapter `lora_name`; answered by LoraAdapterResult."""

    request_id: str  # names the answer
    lora_name: str
    lora_path: str


class UnloadLoraAdapter(_Msg, tag="unload_lora"):
    request_id: str
    lora_name: str


ToEngine = AddRequest | AbortRequests | Shutdown | LoadLoraAdapter | UnloadLoraAdapter


# ---- engine -> gateway -----------------------------------------------------------------


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class PositionLogprobs(msgspec.Struct, array_like=True):
    """The sampled token's logprob and the top-n alternatives at one output position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[TokenLogprob] = []


class RequestMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What happened to one choice inside the engine, sent once on its terminal delta.
    Times are time.time() of the engine's host."""

    scheduled_time: float | None = None  # first admission (left the queue)
    first_token_time: float | None = None  # its first output token was sampled
    finished_time: float = 0.0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions by recompute
    num_spec_draft_tokens: int = 0  # speculative draft tokens proposed for it
    num_spec_accepted_tokens: int = 0  # of those, accepted


class TokenDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New output tokens of one request in one engine step; `finish_reason` set means terminal."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None  # FINISH_*; None while the request runs
    stop_reason: int | None = None  # the stop token id that ended it, if any
    error: str | None = None  # with FINISH_ERROR: what went wrong, for the client
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when asked for
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    index: int = 0  # which choice (0 .. n-1) when the request asked for n > 1
    cumulative_logprob: float | None = None  # with best_of: the choice's total logprob so far
    scheduled_time: float | None = None  # on a choice's first delta: time.time() it left the queue
    metrics: RequestMetrics | None = None  # on the terminal delta of a choice the engine ran
    # with sampling.prompt_logprobs, on choice 0's first delta: prompt tokens 1 .. P-1 (the
    # first prompt token has no logprob), each with its logprob, rank and top alternatives
    prompt_logprobs: list[PositionLogprobs] | None = None
    # with FINISH_ERROR: the request field at fault (e.g. "response_format" for a grammar the
    # engine refused or could not compile in time); the gateway answers 400 naming it
    error_param: str | None = None
    # a pooling request's vector, on its terminal delta (ipc/pooling.py)
    pooled: list[float] | None = None
    # these tokens were forced by the grammar's budget closing: what the model had begun is
    # being cut short to fit max_tokens (the gateway never returns a tool call so cut)
    forced_closing: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative prompt tokens computed
    generation_tokens: int = 0  # cumulative tokens sampled
    prefix_cache_queries: int = 0  # cumulative
    prefix_cache_hits: int = 0  # cumulative
    num_preemptions_swap: int = 0  # cumulative, preemptions that swapped KV to the CPU pool
    num_preemptions_recompute: int = 0  # cumulative, preemptions that drop KV and recompute
    swap_out_bytes: int = 0  # cumulative
    swap_in_bytes: int = 0  # cumulative
    kv_cpu_blocks_total: int = 0
    kv_cpu_blocks_free: int = 0
    spec_draft_tokens: int = 0  # cumulative draft tokens proposed
    spec_accepted_tokens: int = 0  # cumulative draft tokens accepted
    spec_verify_steps: int = 0  # cumulative verifications (one per speculating request-step)
    spec_accepted_by_position: list[int] = []  # [i]: drafts accepted at position i
    grammar_compiles: int = 0  # cumulative grammars compiled (structured outputs)
    grammar_cache_hits: int = 0  # cumulative requests whose grammar was already cached
    grammar_waits: int = 0  # cumulative requests that waited for their grammar to compile
    grammar_failures: int = 0  # cumulative grammars refused or timed out
    grammar_compile_seconds_sum: float = 0.0
    # cumulative compiles per GRAMMAR_COMPILE_BUCKETS bound (<=), the last entry is +Inf
    grammar_compile_seconds_buckets: list[int] = []
    lora_adapters: int = 0  # LoRA adapters loaded (servable by name)
    lora_slots_total: int = 0  # device slots (max_loras); 0: LoRA off
    lora_slots_used: int = 0  # of those, holding an adapter
    lora_cpu_bytes: int = 0  # host bytes of the adapters read (the max_cpu_loras cache)


class EngineReady(_Msg, tag="ready"):
    model: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    incarnation: str = ""
    eos_token_ids: list[int] = []
    tokenizer: str = ""  # a directory with tokenizer.json + tokenizer_config.json
    max_num_seqs: int = 0  # most requests it runs at once (0: not reported)
    max_logprobs: int = EngineConfig.max_logprobs  # most top logprobs a request may ask
    pooling: PoolingInfo | None = None  # how it pools embedding requests (None: it cannot)


class StepOutputs(_Msg, tag="outputs"):
    deltas: list[TokenDelta]
    stats: EngineStats | None = None
    incarnation: str = ""


class Heartbeat(_Msg, tag="heartbeat"):
    step: int
    queue_depth: int
    stats: EngineStats | None = None
    incarnation: str = ""
    # ipc.prefix_hash.pack_digest of the blocks in its prefix cache (for prefix-aware routing)
    prefix_digest: bytes = b""


class EngineDead(_Msg, tag="dead"):
    reason: str
    incarnation: str = ""


class LoraAdapterResult(_Msg, tag="lora_result"):
    """The answer to LoadLoraAdapter / UnloadLoraAdapter of the same request_id."""

    request_id: str
    error: str | None = None  # None: done
    adapters: list[str] = []  # the adapters loaded after it
    incarnation: str = ""


FromEngine = EngineReady | StepOutputs | Heartbeat | EngineDead | LoraAdapterResult
