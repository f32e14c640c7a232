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
    Message,
    PromptTokensDetails,
    Timeline,
    TokenLogprobs,
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
    """Builds one stream's chunks: each choice's first chat delta carries the role, its last
    one its finish_reason; choice i of the request is `index_base + i` in the chunks (batched
    prompts: prompt p of a request with n choices starts at p * n, as OpenAI numbers them)."""

    def __init__(self, gen: Generation, namer: TokenNamer, index_base: int = 0) -> None:
        self._gen = gen
        self._namer = namer
        self._base = index_base
        self._sent_role: set[int] = set()
        self._offset: dict[int, int] = {}

    def chunk(self, piece: Piece) -> Chunk | None:
        job = self._gen.job
        wants_logprobs = job.sampling.logprobs is not None and piece.logprobs
        first = piece.index not in self._sent_role
        if not (piece.text or piece.finish_reason or wants_logprobs or first):
            return None
        last = piece.finish_reason is not None and self._gen.finish_reason is not None
        timeline = timeline_of(self._gen) if last else UNSET
        index = self._base + piece.index
        if job.kind == "chat":
            delta = Delta(content=piece.text or None)
            if first:
                delta.role, delta.content = "assistant", piece.text
                self._sent_role.add(piece.index)
            lp = self._namer.chat(piece.logprobs) if wants_logprobs else None
            choice = ChatChunkChoice(index, delta, lp, piece.finish_reason)
            return ChatCompletionChunk(job.request_id, job.created, job.model, [choice],
                                       timeline=timeline)
        self._sent_role.add(piece.index)
        offset = self._offset.get(piece.index, 0)
        lp = self._namer.completion(piece.logprobs, offset) if wants_logprobs else None
        self._offset[piece.index] = offset + len(piece.text)
        choice = CompletionChoice(index, piece.text, lp, piece.finish_reason)
        return Completion(job.request_id, job.created, job.model, [choice], timeline=timeline)

    def usage_chunk(self) -> Chunk:
        job = self._gen.job
        if job.kind == "chat":
            return ChatCompletionChunk(
                job.request_id, job.created, job.model, [], usage=usage_of(self._gen)
            )
        return Completion(job.request_id, job.created, job.model, [], usage=usage_of(self._gen))


class _Collected:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.cumulative_logprob: float | None = None


class Accumulator:
    """Collects pieces into the single JSON response of a non-streaming request; with best_of
    it keeps the n choices of highest cumulative logprob (renumbered 0 .. n-1)."""

    def __init__(self, gen: Generation, namer: TokenNamer) -> None:
        self._gen = gen
        self._namer = namer
        self._choices = [_Collected() for _ in range(gen.job.sampling.num_choices)]

    def add(self, piece: Piece) -> None:
        c = self._choices[piece.index]
        c.text.append(piece.text)
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

    def choices(self, index_base: int = 0) -> list[ChatChoice] | list[CompletionChoice]:
        job = self._gen.job
        want = job.sampling.logprobs is not None
        out: list = []
        for i, c in enumerate(self.kept()):
            text = "".join(c.text)
            if job.kind == "chat":
                lp = self._namer.chat(c.logprobs) if want else None
                out.append(ChatChoice(index_base + i, Message("assistant", text), lp,
                                      c.finish_reason))
            else:
                lp = self._namer.completion(c.logprobs, 0) if want else None
                out.append(CompletionChoice(index_base + i, text, lp, c.finish_reason))
        return out

    def response(self) -> ChatCompletion | Completion:
        job = self._gen.job
        if job.kind == "chat":
            return ChatCompletion(job.request_id, job.created, job.model, self.choices(),
                                  usage_of(self._gen), timeline=timeline_of(self._gen))
        return Completion(job.request_id, job.created, job.model, self.choices(),
                          usage_of(self._gen), timeline=timeline_of(self._gen))
