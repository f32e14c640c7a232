"""In-process API: `LLM(model, **options).generate(prompts, params)` over one EngineCore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.tokenizer import load_tokenizer
from ipc.config import EngineConfig
from ipc.messages import FINISH_STOP, AddRequest, TokenDelta
from ipc.sampling import SamplingParams
from ipc.text import IncrementalDetokenizer, StopMatcher

Prompt = str | dict


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # per output token: {token_id: logprob} with the sampled token and the top-n alternatives
    logprobs: list[dict[int, float]] | None = None


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
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Bad input raises ValueError before anything runs."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if not prompt_list:
            raise ValueError("prompts must not be empty")
        params = _broadcast(sampling_params, len(prompt_list))
        trackers = [self._tracker(p, s) for p, s in zip(prompt_list, params, strict=True)]
        self._submit(trackers)
        live = {t.output.request_id: t for t in trackers}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                self._on_delta(live, delta)
        return [t.output for t in trackers]

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

    def _tracker(self, prompt: Prompt, params: SamplingParams) -> _Tracker:
        text, ids = _prompt_ids(prompt, self.tokenizer)
        out = RequestOutput(str(next(self._ids)), text, ids)
        if params.logprobs is not None:
            out.logprobs = []
        return _Tracker(out, params, self.tokenizer)

    def _submit(self, trackers: list[_Tracker]) -> None:
        added: list[str] = []
        try:
            for t in trackers:
                self.engine.add_request(AddRequest(
                    request_id=t.output.request_id,
                    prompt_token_ids=t.output.prompt_token_ids,
                    sampling=t.params,
                ))
                added.append(t.output.request_id)
        except ValueError:
            self.engine.abort_requests(added)
            raise

    def _on_delta(self, live: dict[str, _Tracker], delta: TokenDelta) -> None:
        tracker = live.get(delta.request_id)
        if tracker is None:
            return  # a request this call already finished (stopped on a string)
        if tracker.add(delta):
            del live[delta.request_id]
            if not delta.finished:  # stopped on a string: the engine still holds it
                self.engine.abort_requests([delta.request_id])


class _Tracker:
    """Turns one request's deltas into text, applying stop strings."""

    def __init__(self, output: RequestOutput, params: SamplingParams, tokenizer) -> None:
        self.output = output
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopMatcher(params.stop, params.include_stop_str_in_output)

    def add(self, delta: TokenDelta) -> bool:
        """Consume a delta; True when the request is finished."""
        out = self.output
        tokens = delta.new_token_ids
        out.token_ids.extend(tokens)
        if delta.logprobs is not None and out.logprobs is not None:
            out.logprobs.extend(
                {p.token_id: p.logprob, **{t.token_id: t.logprob for t in p.top}}
                for p in delta.logprobs
            )
        if delta.stop_reason is not None and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]  # the stop token's text is not part of the output
        text = self.detok.add(tokens)
        if delta.finished:
            text += self.detok.flush()
        emitted, stopped = self.stops.push(text)
        out.text += emitted
        if stopped:
            out.finish_reason, out.stop_reason = FINISH_STOP, self.stops.matched
            return True
        if delta.finished:
            out.text += self.stops.flush()
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
            return True
        return False


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
