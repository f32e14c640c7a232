"""Decoding and checking of request bodies: typed decode (every failure a 400 naming the
field), the cross-field rules, the mapping onto SamplingParams, and the one limits check."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

from gateway.errors import ApiError
from gateway.refused import check_refused
from gateway.requests import AnyRequest, ChatCompletionRequest, CompletionRequest
from ipc.limits import LimitError, Limits
from ipc.limits import check_limits as limits_check
from ipc.limits import check_token_ids as limits_token_ids
from ipc.sampling import SamplingParams, StructuredOutputs

MAX_PROMPTS = 64  # prompts in one completions request

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_request(body: bytes, kind: type[AnyRequest]) -> AnyRequest:
    """Parse and type-check a generation request; every failure is a 400 ApiError."""
    request = decode_body(body, kind)
    check_refused(body, chat=kind is ChatCompletionRequest)
    check_request(request)
    return request


def decode_body(body: bytes, kind: Any) -> Any:
    """Parse and type-check a body as `kind`; every failure is a 400 ApiError."""
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise ApiError(400, "JSON is nested too deeply", "invalid_json") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        param = match.group(1) if match else None
        if "missing required field" in message:
            code = "missing_required_parameter"
            name = re.search(r"field `([^`]*)`", message)
            field = name.group(1) if name else None
            param = f"{param}.{field}" if param and field else (field or param)
        else:  # NOTE: no path means the body itself is wrong (e.g. an array, not an object)
            code = "invalid_value" if param else "invalid_json"
        raise ApiError(400, message, code, param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", "invalid_json") from None


def check_request(request: AnyRequest) -> None:
    best_of = getattr(request, "best_of", None)
    if request.stream and best_of is not None and best_of != request.n:
        raise ApiError(400, "best_of > n cannot be streamed (the best are known at the end)",
                       "invalid_value", "best_of")
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise ApiError(400, "messages must not be empty", "invalid_value", "messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "invalid_value", "top_logprobs")
        if request.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is only supported on /v1/completions",
                           "unsupported_parameter", "prompt_logprobs")
        if request.continue_final_message and request.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt=false",
                           "invalid_value", "continue_final_message")
    else:
        p = request.prompt
        kinds = {type(q) for q in p} if isinstance(p, list) else {str}
        if len(kinds) > 1:
            raise ApiError(400, "prompt must be a text, a list of texts, a list of token ids or "
                           "a list of token-id lists (not a mix)", "invalid_value", "prompt")
        prompts = request.prompts
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ApiError(400, "prompt must not be empty", "invalid_value", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", "invalid_value",
                           "prompt")


def to_sampling(request: AnyRequest, max_tokens: int | None,
                structured: StructuredOutputs | None = None) -> SamplingParams:
    """Map a request onto SamplingParams (`max_tokens` None: up to the context, filled in by
    `fill_max_tokens` once check_limits passed); its ValueError becomes a 400 naming the field."""
    prompt_logprobs = request.prompt_logprobs
    num_logprobs = request.num_logprobs
    if request.echo and num_logprobs is not None and isinstance(request, CompletionRequest):
        # NOTE: echo with logprobs shows the prompt's tokens' logprobs too (lm-eval's path)
        prompt_logprobs = max(prompt_logprobs or 0, num_logprobs)
    given = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
    }
    return _sampling(
        SamplingParams,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=tuple(request.stop_list),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=num_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        n=request.n,
        best_of=getattr(request, "best_of", None),
        use_beam_search=request.use_beam_search,
        length_penalty=request.length_penalty,
        logit_bias=_logit_bias(request.logit_bias),
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured,
        **{k: v for k, v in given.items() if v is not None},
    )


def check_limits(request: AnyRequest, limits: Limits, prompt_ids: list[int],
                 sampling: SamplingParams) -> None:
    """The one limits check (ipc/limits.py, which the engine runs too), its error a 400 that
    names the route's field."""
    try:
        limits_check(limits, prompt_ids, sampling)
    except LimitError as exc:
        raise ApiError(400, str(exc), exc.code, _route_param(request, exc.field)) from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids a route takes directly (/detokenize), in the limits check's wording."""
    try:
        limits_token_ids(ids, vocab_size, param, indexed=False)
    except LimitError as exc:
        raise ApiError(400, str(exc), exc.code, exc.field) from None


def fill_max_tokens(sampling: SamplingParams, room: int) -> SamplingParams:
    """`max_tokens` left unset asks for the rest of the context (`room` tokens)."""
    if sampling.max_tokens is not None:
        return sampling
    return _sampling(msgspec.structs.replace, sampling, max_tokens=room)


def _sampling(make: Callable[..., SamplingParams], *args: Any, **fields: Any) -> SamplingParams:
    """`make(*args, **fields)`, its ValueError (SamplingParams names the field) a 400."""
    try:
        return make(*args, **fields)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), "invalid_value", param) from None


def _route_param(request: AnyRequest, field: str) -> str:
    """The request field of an AddRequest-side field (ipc.limits.LimitError.field)."""
    chat = isinstance(request, ChatCompletionRequest)
    if field == "prompt":
        return "messages" if chat else "prompt"
    if field == "max_tokens" and chat and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    if field == "logprobs" and chat:
        return "top_logprobs"
    return field


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not key.isdigit():
            raise ApiError(400, f"logit_bias keys are token ids; got `{key}`", "invalid_value",
                           "logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias values must be in [-100, 100]; got {value}",
                           "invalid_value", f"logit_bias.{key}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


