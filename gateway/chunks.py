"""Turn a Generation's pieces into OpenAI chunks (SSE and WS share them) and full responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msgspec import UNSET

from gateway.choice_events import (
    CallArguments,
    CallStart,
    ChoiceEvent,
    ChoiceEvents,
    ReasoningDelta,
    TextDelta,
)
from gateway.generation import Generation, Piece
from gateway.requests import FunctionCall, ToolCall
from gateway.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    Delta,
    FunctionCallDelta,
    Message,
    PromptLogprob,
    PromptTokensDetails,
    Timeline,
    TokenLogprobs,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from ipc.messages import PositionLogprobs

Chunk = ChatCompletionChunk | Completion


class TokenNamer:
    """Token ids to the strings and bytes logprobs show."""

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer

    def text(self, token_id: int) -> str:
        return self._tok.token_text(token_id)  # type: ignore[attr-defined]

    def chat(self, positions: list[PositionLogprobs]) -> ChoiceLogprobs:
        return ChoiceLogprobs([self._chat_one(p) for p in positions])

    def _chat_one(self, pos: PositionLogprobs) -> TokenLogprobs:
        text = self.text(pos.token_id)
        top = [TopLogprob(self.text(t.token_id), t.logprob, _bytes(self.text(t.token_id)))
               for t in pos.top]
        return TokenLogprobs(text, pos.logprob, _bytes(text), top)

    def completion(self, positions: list[PositionLogprobs], offset: int) -> CompletionLogprobs:
        tokens, logprobs, tops, offsets = [], [], [], []
        for pos in positions:
            text = self.text(pos.token_id)
            tokens.append(text)
            logprobs.append(pos.logprob)
            tops.append({self.text(t.token_id): t.logprob for t in pos.top})
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens, logprobs, tops, offsets)


    def prompt_completion(self, prompt_ids: list[int], positions: list[PositionLogprobs],
                          top: int) -> CompletionLogprobs:
        """The prompt's part of echo + logprobs: its first token has no logprob."""
        tokens = [self.text(t) for t in prompt_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        logprobs: list[float | None] = [None] + [p.logprob for p in positions]
        tops: list[dict[str, float] | None] = [None] + [
            {self.text(t.token_id): t.logprob for t in p.top[:top]} for p in positions]
        return CompletionLogprobs(tokens, logprobs, tops, offsets)

    def vllm_prompt(
        self, positions: list[PositionLogprobs]
    ) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per prompt token, it and its top alternatives."""
        out: list[dict[str, PromptLogprob] | None] = [None]
        for p in positions:
            entry = {str(t.token_id): PromptLogprob(t.logprob, rank, self.text(t.token_id))
                     for rank, t in enumerate(p.top, start=1)}
            entry[str(p.token_id)] = PromptLogprob(p.logprob, p.rank, self.text(p.token_id))
            out.append(entry)
        return out


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                              a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)


def _prompt_parts(gen: Generation, namer: TokenNamer, lp: CompletionLogprobs | None):
    """A completion choice's logprobs with the prompt's in front (echo + logprobs), and its
    vLLM prompt_logprobs (or UNSET)."""
    job, positions = gen.job, gen.prompt_logprobs or []
    if lp is not None and job.echo:
        lp = _join(namer.prompt_completion(job.prompt_ids, positions,
                                           job.sampling.logprobs or 0), lp)
    shown = namer.vllm_prompt(positions) if job.show_prompt_logprobs else UNSET
    return lp, shown


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def usage_of(*gens: Generation, reasoning_tokens: int | None = None) -> Usage:
    """Usage of one request, summed over its prompts (each prompt counted once, every choice's
    tokens counted, as OpenAI bills n and best_of); `reasoning_tokens` (None: the request had
    no reasoning parser) becomes completion_tokens_details."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    u = {k: sum(g.usage[k] for g in gens) for k in keys}
    details = (CompletionTokensDetails(reasoning_tokens) if reasoning_tokens is not None
               else None)
    return Usage(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"],
                 PromptTokensDetails(u["cached_tokens"]), details)


def timeline_of(gen: Generation) -> Timeline:
    m = gen.engine_metrics
    return Timeline(
        queued=gen.job.arrival,
        scheduled=gen.scheduled_time or (m.scheduled_time if m is not None else None),
        first_token=gen.first_token_time,
        finished=gen.finished_time or gen.job.arrival,
        preemptions=None if m is None else m.num_preemptions,
        recomputed_tokens=None if m is None else m.num_recomputed_tokens,
        cached_tokens=gen.cached_tokens,
        spec_draft_tokens=None if m is None else m.num_spec_draft_tokens,
        spec_accepted_tokens=None if m is None else m.num_spec_accepted_tokens,
    )


class ChunkBuilder:
    """Builds one prompt's chunks: each choice's first chat delta carries the role (and the
    echo), its last one its finish_reason; choice i is `job.index_base + i` in the chunks
    (batched prompts: prompt p of a request with n choices starts at p * n, as OpenAI).
    Chat text goes through the choice's ChoiceEvents (reasoning, answer, tool calls)."""

    def __init__(self, gen: Generation, namer: TokenNamer, timeline: bool = True) -> None:
        self._gen = gen
        self._namer = namer
        self._base = gen.job.index_base
        self._id = gen.job.response_id or gen.job.request_id
        self._timeline = timeline  # NOTE: False for batched prompts: a timeline is per prompt
        self._sent_role: set[int] = set()
        self._offset: dict[int, int] = {}
        self._events: dict[int, ChoiceEvents] = {}  # choice index -> its events (chat)

    def chunk(self, piece: Piece) -> Chunk | None:
        job = self._gen.job
        if job.kind != "chat":
            return self._completion_chunk(piece)
        wants_logprobs = job.sampling.logprobs is not None and piece.logprobs
        first = piece.index not in self._sent_role
        events = self._choice(piece.index).feed(piece)
        text = _joined(events, TextDelta)
        reasoning = _joined(events, ReasoningDelta) or None
        calls = _call_deltas(events) or None
        if not (text or reasoning or calls or piece.finish_reason or wants_logprobs or first):
            return None
        text = job.echo + text if first else text
        delta = Delta(content=text or None, tool_calls=calls, reasoning_content=reasoning,
                      reasoning=reasoning)
        if first:
            delta.role, delta.content = "assistant", text
            self._sent_role.add(piece.index)
        lp = self._namer.chat(piece.logprobs) if wants_logprobs else None
        reason = self.finish_reason(piece.finish_reason, piece.index)
        choice = ChatChunkChoice(self._base + piece.index, delta, lp, reason)
        return ChatCompletionChunk(self._id, job.created, job.model, [choice],
                                   timeline=self._timeline_for(piece))

    def _completion_chunk(self, piece: Piece) -> Completion:
        job = self._gen.job
        first = piece.index not in self._sent_role
        self._sent_role.add(piece.index)
        text = job.echo + piece.text if first else piece.text
        offset = self._offset.get(piece.index, len(job.echo))
        wants_logprobs = job.sampling.logprobs is not None and (bool(piece.logprobs) or first)
        lp = self._namer.completion(piece.logprobs or [], offset) if wants_logprobs else None
        self._offset[piece.index] = offset + len(piece.text)
        prompt_lp = UNSET
        if first:
            lp, prompt_lp = _prompt_parts(self._gen, self._namer, lp)
        choice = CompletionChoice(self._base + piece.index, text, lp, piece.finish_reason,
                                  prompt_lp)
        return Completion(self._id, job.created, job.model, [choice],
                          timeline=self._timeline_for(piece))

    def _timeline_for(self, piece: Piece) -> Timeline | Any:
        last = piece.finish_reason is not None and self._gen.finish_reason is not None
        return timeline_of(self._gen) if last and self._timeline else UNSET

    def _choice(self, index: int) -> ChoiceEvents:
        if index not in self._events:
            self._events[index] = ChoiceEvents(self._gen.job)
        return self._events[index]

    def finish_reason(self, reason: str | None, index: int = 0) -> str | None:
        """The client's finish_reason for choice `index`: a stop after tool calls is
        `tool_calls`."""
        events = self._events.get(index)
        return events.finish_reason(reason) if events is not None else reason

    @property
    def reasoning_tokens(self) -> int | None:
        """Reasoning tokens of every choice so far (None: the request has no reasoning
        parser)."""
        if self._gen.job.reasoning_parser is None:
            return None
        return sum(e.reasoning_tokens for e in self._events.values())


def usage_chunk(gens: list[Generation], builders: Sequence[ChunkBuilder] = ()) -> Chunk:
    """The stream's last chunk with stream_options.include_usage: no choices, the usage."""
    job = gens[0].job
    rid = job.response_id or job.request_id
    usage = usage_of(*gens, reasoning_tokens=_reasoning_total(
        [b.reasoning_tokens for b in builders]))
    if job.kind == "chat":
        return ChatCompletionChunk(rid, job.created, job.model, [], usage=usage)
    return Completion(rid, job.created, job.model, [], usage=usage)


def _reasoning_total(counts: list[int | None]) -> int | None:
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


class _Collected:
    def __init__(self, events: ChoiceEvents | None) -> None:
        self.events = events  # chat: the choice's reasoning / answer / tool-call split
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.cumulative_logprob: float | None = None


class Accumulator:
    """Collects pieces into the single JSON response of a non-streaming request; with best_of
    it keeps the n choices of highest cumulative logprob (renumbered 0 .. n-1)."""

    def __init__(self, gen: Generation, namer: TokenNamer) -> None:
        self._gen = gen
        self._namer = namer
        chat = gen.job.kind == "chat"
        self._choices = [_Collected(ChoiceEvents(gen.job) if chat else None)
                         for _ in range(gen.job.sampling.num_choices)]

    def add(self, piece: Piece) -> None:
        c = self._choices[piece.index]
        if c.events is None:
            c.text.append(piece.text)
        else:
            events = c.events.feed(piece)
            c.text.append(_joined(events, TextDelta))
            c.reasoning.append(_joined(events, ReasoningDelta))
        if piece.logprobs:
            c.logprobs.extend(piece.logprobs)
        if piece.cumulative_logprob is not None:
            c.cumulative_logprob = piece.cumulative_logprob
        c.finish_reason = piece.finish_reason or c.finish_reason

    def kept(self) -> list[_Collected]:
        """The choices returned, in order."""
        s = self._gen.job.sampling
        choices = list(self._choices)
        if s.best_of:
            choices.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
        return choices[: s.n]

    @property
    def reasoning_tokens(self) -> int | None:
        """Reasoning tokens of every choice sampled (None: no reasoning parser)."""
        if self._gen.job.reasoning_parser is None:
            return None
        return sum(c.events.reasoning_tokens for c in self._choices if c.events is not None)

    def choices(self) -> list[ChatChoice] | list[CompletionChoice]:
        job = self._gen.job
        want = job.sampling.logprobs is not None
        out: list = []
        for i, c in enumerate(self.kept(), start=job.index_base):
            text = job.echo + "".join(c.text)
            if c.events is not None:
                lp = self._namer.chat(c.logprobs) if want else None
                message = _message(c.events, text, "".join(c.reasoning),
                                   job.reasoning_parser is not None)
                out.append(ChatChoice(i, message, lp, c.events.finish_reason(c.finish_reason)))
            else:
                lp = self._namer.completion(c.logprobs, len(job.echo)) if want else None
                lp, prompt_lp = _prompt_parts(self._gen, self._namer, lp)
                out.append(CompletionChoice(i, text, lp, c.finish_reason, prompt_lp))
        return out


def _message(events: ChoiceEvents, text: str, reasoning: str, parsed: bool) -> Message:
    """One choice's message: its tool calls (then content is the text around them, stripped,
    or null), and with a reasoning parser its reasoning (null when it had none)."""
    message = Message("assistant", text)
    if events.calls:
        message.content = text.strip() or None
        message.tool_calls = [ToolCall(i, FunctionCall(name, args))
                              for i, name, args in events.calls]
    if parsed:
        message.reasoning_content = message.reasoning = reasoning or None
    return message


def response_of(accs: list[Accumulator]) -> ChatCompletion | Completion:
    """The JSON response of a request (of all its prompts, choices in index order)."""
    gens = [a._gen for a in accs]
    job = gens[0].job
    rid = job.response_id or job.request_id
    choices = [c for a in accs for c in a.choices()]
    usage = usage_of(*gens, reasoning_tokens=_reasoning_total([a.reasoning_tokens for a in accs]))
    if job.kind == "chat":
        return ChatCompletion(rid, job.created, job.model, choices, usage,  # type: ignore[arg-type]
                              timeline=timeline_of(gens[0]))
    timeline = timeline_of(gens[0]) if len(gens) == 1 else UNSET
    return Completion(rid, job.created, job.model, choices, usage,  # type: ignore[arg-type]
                      timeline=timeline)


def _joined(events: list[ChoiceEvent], kind: type[TextDelta] | type[ReasoningDelta]) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def _call_deltas(events: list[ChoiceEvent]) -> list[ToolCallDelta]:
    """A piece's call events as OpenAI tool_call deltas, argument fragments merged per call."""
    out: list[ToolCallDelta] = []
    for e in events:
        if isinstance(e, CallStart):
            out.append(ToolCallDelta(e.index, FunctionCallDelta(e.name, ""), e.id, "function"))
        elif not isinstance(e, CallArguments):
            continue
        elif out and out[-1].index == e.index:
            out[-1].function.arguments = (out[-1].function.arguments or "") + e.arguments
        else:
            out.append(ToolCallDelta(e.index, FunctionCallDelta(arguments=e.arguments)))
    return out
