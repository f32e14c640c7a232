"""In-process API: `LLM(model, **options).generate(prompts, params)` over one EngineCore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.tokenizer import load_tokenizer
from ipc.config import EngineConfig
from ipc.messages import FINISH_STOP, AddRequest, PositionLogprobs, RequestMetrics, TokenDelta
from ipc.sampling import SamplingParams
from ipc.text import ChoiceText

Prompt = str | dict


@dataclass
class CompletionOutput:
    """One choice of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # per output token: {token_id: logprob} with the sampled token and the top-n alternatives
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # with best_of: what the choices are ranked by
    # the engine's timeline of this choice (None when a stop string ended it here)
    metrics: RequestMetrics | None = None
    error: str | None = None  # with finish_reason "error": why (e.g. a grammar that failed)
    error_param: str | None = None  # and the request field at fault


@dataclass
class RequestOutput:
    """The result for one prompt; `.text`, `.token_ids`, ... are those of the first choice."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} with the token
    # and its top alternatives; None for the first token (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


class LLM:
    """Every EngineConfig field is a keyword option (`max_num_seqs=8`, `block_size=16`, ...)."""

    def __init__(self, model: str | None = None, **options: object) -> None:
        self.config = EngineConfig(model=model, **options)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.engine.tokenizer_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Bad input raises ValueError before anything runs.
        lora: the loaded LoRA adapter each prompt runs under (one name for all; None: base)."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if not prompt_list:
            raise ValueError("prompts must not be empty")
        params = _broadcast(sampling_params, len(prompt_list))
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise ValueError("lora: one adapter name (or None) per prompt")
        results = [self._result(p, s) for p, s in zip(prompt_list, params, strict=True)]
        self._submit(results, params, loras)
        live = {(c.output.request_id, c.choice.index): c for r in results for c in r.trackers}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                self._on_delta(live, delta)
        return [r.finish() for r in results]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.apply_chat_template(
                c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    # ---- helpers ---------------------------------------------------------------------------

    def _result(self, prompt: Prompt, params: SamplingParams) -> _Result:
        text, ids = _prompt_ids(prompt, self.tokenizer)
        out = RequestOutput(str(next(self._ids)), text, ids, [])
        return _Result(out, params, self.tokenizer)

    def _submit(self, results: list[_Result], params: list[SamplingParams],
                loras: list[str | None]) -> None:
        added: list[str] = []
        try:
            for r, p, lora in zip(results, params, loras, strict=True):
                self.engine.add_request(AddRequest(
                    request_id=r.output.request_id,
                    prompt_token_ids=r.output.prompt_token_ids,
                    sampling=p,
                    lora_name=lora,
                ))
                added.append(r.output.request_id)
        except ValueError:
            self.engine.abort_requests(added)
            raise

    def _on_delta(self, live: dict[tuple[str, int], _Choice], delta: TokenDelta) -> None:
        key = (delta.request_id, delta.index)
        choice = live.get(key)
        if choice is None:
            return  # a choice this call already finished (stopped on a string)
        if choice.add(delta):
            del live[key]
            if not delta.finished:  # stopped on a string: the engine still runs it
                self.engine.abort_choice(delta.request_id, delta.index)


class _Result:
    """Collects the choices of one request; best_of keeps the n most likely at the end."""

    def __init__(self, output: RequestOutput, params: SamplingParams, tokenizer) -> None:
        self.output = output
        self.params = params
        self.trackers = [_Choice(output, i, params, tokenizer) for i in range(params.num_choices)]

    def finish(self) -> RequestOutput:
        choices = [t.choice for t in self.trackers]
        if self.params.best_of:
            choices.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            choices = choices[: self.params.n]
            for i, c in enumerate(choices):
                c.index = i
        self.output.outputs = choices
        return self.output


class _Choice:
    """Turns one choice's deltas into text, applying stop strings."""

    def __init__(self, output: RequestOutput, index: int, params: SamplingParams,
                 tokenizer) -> None:
        self.output = output
        self.choice = CompletionOutput(index)
        if params.logprobs is not None:
            self.choice.logprobs = []
        self.params = params
        self.text = ChoiceText(tokenizer, params.skip_special_tokens, params.stop,
                               params.include_stop_str_in_output)

    def add(self, delta: TokenDelta) -> bool:
        """Consume a delta; True when the choice is finished."""
        out = self.choice
        self.output.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None] + [_as_dict(p) for p in delta.prompt_logprobs]
        tokens = delta.new_token_ids
        out.token_ids.extend(tokens)
        out.cumulative_logprob = delta.cumulative_logprob
        if delta.logprobs is not None and out.logprobs is not None:
            out.logprobs.extend(_as_dict(p) for p in delta.logprobs)
        emitted, stopped = self.text.add(tokens, delta.finished, delta.stop_reason is not None)
        out.text += emitted
        if stopped:
            out.finish_reason, out.stop_reason = FINISH_STOP, self.text.matched
            return True
        if delta.finished:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
            out.metrics = delta.metrics
            out.error, out.error_param = delta.error, delta.error_param
            return True
        return False


def _as_dict(p: PositionLogprobs) -> dict[int, float]:
    return {p.token_id: p.logprob, **{t.token_id: t.logprob for t in p.top}}


def _prompt_ids(prompt: Prompt, tokenizer) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, tokenizer(prompt)["input_ids"]
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return prompt.get("prompt"), list(ids)
    raise ValueError("a prompt is a string or {'prompt_token_ids': [...]}")


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
