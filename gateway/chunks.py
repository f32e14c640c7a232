"""Turn a Generation's pieces into OpenAI chunks (SSE and WS share them) and full responses."""

from __future__ import annotations

from msgspec import UNSET

from gateway.generation import Generation, Piece
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    Message,
    PromptTokensDetails,
    Timeline,
    TokenLogprobs,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from gateway.tool_calls import CallEvent
from ipc.messages import FINISH_STOP, PositionLogprobs

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


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def usage_of(gen: Generation) -> Usage:
    u = gen.usage
    return Usage(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"],
                 PromptTokensDetails(u["cached_tokens"]))


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
    """Builds one stream's chunks: the role in the first chat delta, finish_reason on the last."""

    def __init__(self, gen: Generation, namer: TokenNamer) -> None:
        self._gen = gen
        self._namer = namer
        self._sent_role = False
        self._offset = 0
        self._tools = gen.job.tool_parser() if gen.job.tool_parser is not None else None

    def chunk(self, piece: Piece) -> Chunk | None:
        job = self._gen.job
        wants_logprobs = job.sampling.logprobs is not None and piece.logprobs
        text, calls = piece.text, None
        if self._tools is not None:
            events = self._tools.feed(piece.text, final=piece.finish_reason is not None)
            text = "".join(e.content for e in events if e.index is None)
            calls = _call_deltas(events) or None
        if not (text or calls or piece.finish_reason or wants_logprobs or not self._sent_role):
            return None
        timeline = timeline_of(self._gen) if piece.finish_reason else UNSET
        if job.kind == "chat":
            delta = Delta(content=text or None, tool_calls=calls)
            if not self._sent_role:
                delta.role, delta.content = "assistant", text
                self._sent_role = True
            lp = self._namer.chat(piece.logprobs) if wants_logprobs else None
            choice = ChatChunkChoice(0, delta, lp, self.finish_reason(piece.finish_reason))
            return ChatCompletionChunk(job.request_id, job.created, job.model, [choice],
                                       timeline=timeline)
        lp = self._namer.completion(piece.logprobs, self._offset) if wants_logprobs else None
        self._offset += len(piece.text)
        choice = CompletionChoice(0, piece.text, lp, piece.finish_reason)
        return Completion(job.request_id, job.created, job.model, [choice], timeline=timeline)

    def finish_reason(self, reason: str | None) -> str | None:
        """The client's finish_reason: a stop after tool calls is `tool_calls`."""
        if reason == FINISH_STOP and self._tools is not None and self._tools.calls:
            return "tool_calls"
        return reason

    def usage_chunk(self) -> Chunk:
        job = self._gen.job
        if job.kind == "chat":
            return ChatCompletionChunk(
                job.request_id, job.created, job.model, [], usage=usage_of(self._gen)
            )
        return Completion(job.request_id, job.created, job.model, [], usage=usage_of(self._gen))


class Accumulator:
    """Collects pieces into the single JSON response of a non-streaming request."""

    def __init__(self, gen: Generation, namer: TokenNamer) -> None:
        self._gen = gen
        self._namer = namer
        self._text: list[str] = []
        self._logprobs: list[PositionLogprobs] = []

    def add(self, piece: Piece) -> None:
        self._text.append(piece.text)
        if piece.logprobs:
            self._logprobs.extend(piece.logprobs)

    def response(self, finish_reason: str | None) -> ChatCompletion | Completion:
        job = self._gen.job
        text = "".join(self._text)
        want = job.sampling.logprobs is not None
        if job.kind == "chat":
            lp = self._namer.chat(self._logprobs) if want else None
            message = Message("assistant", text)
            if job.tool_parser is not None:
                parser = job.tool_parser()
                events = parser.feed(text, final=True)
                if parser.calls:
                    content = "".join(e.content for e in events if e.index is None).strip()
                    message = Message("assistant", content or None, [
                        ToolCall(i, FunctionCall(name, args)) for i, name, args in parser.calls])
                    if finish_reason == FINISH_STOP:
                        finish_reason = "tool_calls"
            choice = ChatChoice(0, message, lp, finish_reason)
            return ChatCompletion(job.request_id, job.created, job.model, [choice],
                                  usage_of(self._gen), timeline=timeline_of(self._gen))
        lp = self._namer.completion(self._logprobs, 0) if want else None
        return Completion(job.request_id, job.created, job.model,
                          [CompletionChoice(0, text, lp, finish_reason)], usage_of(self._gen),
                          timeline=timeline_of(self._gen))


def _call_deltas(events: list[CallEvent]) -> list[ToolCallDelta]:
    """A piece's call events as OpenAI tool_call deltas, argument fragments merged per call."""
    out: list[ToolCallDelta] = []
    for e in events:
        if e.index is None:
            continue
        if e.name is not None:
            out.append(ToolCallDelta(e.index, FunctionCallDelta(e.name, ""), e.id, "function"))
        elif out and out[-1].index == e.index:
            out[-1].function.arguments = (out[-1].function.arguments or "") + e.arguments
        else:
            out.append(ToolCallDelta(e.index, FunctionCallDelta(arguments=e.arguments)))
    return out
