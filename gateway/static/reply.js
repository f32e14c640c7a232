// One streamed answer of the chat page: applies chat chunks to its message (content, reasoning,
// tool calls), and follows a resumable stream to [DONE], reconnecting after a broken connection
// with GET /v1/streams/{id}?after=<seq> (docs/resume.md), so the text continues exactly once.
import { APIConnectionError, iterEvents, streamError } from './sdk/index.js';

export class Reply {
  /** `hooks`: { save(), onEvent(reply), onConnection('connected' | 'reconnecting') }. */
  constructor(conv, msg, hooks) {
    this.conv = conv;
    this.hooks = hooks;
    this.msg = msg;
    this.controller = new AbortController();
    this.requestId = null;
    this.start = performance.now();
    this.first = null;
    this.tokens = 0;
    this.finish = null;
    this.stopped = false;
    this.frame = 0;
    this.savedAt = 0;
  }

  apply(chunk) {
    if (chunk.usage) this.tokens = chunk.usage.completion_tokens ?? this.tokens;
    for (const choice of chunk.choices ?? []) {
      const d = choice.delta ?? {};
      const reasoning = d.reasoning_content ?? d.reasoning;
      if (d.content || reasoning || d.tool_calls) {
        this.first ??= performance.now();
        if (!chunk.usage) this.tokens += 1; // NOTE: an estimate until the usage chunk
      }
      if (d.content) this.msg.content += d.content;
      if (reasoning) this.msg.reasoning = (this.msg.reasoning ?? '') + reasoning;
      for (const t of d.tool_calls ?? []) {
        const calls = (this.msg.tool_calls ??= []);
        calls[t.index] ??= { id: '', name: '', arguments: '' };
        const call = calls[t.index];
        if (t.id) call.id = t.id;
        if (t.function?.name) call.name += t.function.name;
        if (t.function?.arguments) call.arguments += t.function.arguments;
      }
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
  }

  stats(status) {
    const now = performance.now();
    const ttft = this.first === null ? '–' : `${Math.round(this.first - this.start)} ms`;
    const seconds = this.first === null ? 0 : (now - this.first) / 1000;
    const rate = seconds > 0 && this.tokens > 1 ? ((this.tokens - 1) / seconds).toFixed(1) : '–';
    const count = `${this.tokens} token${this.tokens === 1 ? '' : 's'}`;
    return `TTFT ${ttft} · ${rate} tokens/s · ${count}${status ? ` · ${status}` : ''}`;
  }

  /** Save now and then while streaming, so a reload finds the text so far. */
  persist(force = false) {
    const now = performance.now();
    if (!force && now - this.savedAt < 400) return;
    this.savedAt = now;
    this.hooks.save();
  }
}

const RESUME_FOR_MS = 60_000; // NOTE: past the server's grace period (30 s by default) it is gone
const BACKOFF_MS = [250, 500, 1000, 2000];

async function readEvents(reply, response) {
  for await (const event of iterEvents(response.body)) {
    if (event.data === '[DONE]') return true;
    const payload = JSON.parse(event.data);
    if (event.event === 'error' || payload.error) throw streamError(payload, reply.requestId);
    reply.apply(payload);
    // NOTE: the id moves with the text it covers, so a saved conversation resumes right after it
    if (event.id && reply.conv.pending) reply.conv.pending.lastEventId = event.id;
    reply.hooks.onEvent(reply);
    reply.persist();
  }
  return false; // NOTE: the body ended without [DONE]: the connection broke
}

function brokenConnection(err) {
  return err instanceof APIConnectionError || err instanceof TypeError;
}

/** GET /v1/streams/{id}?after=<seq>: the events after the last one this page applied. */
async function reopen(reply, client) {
  const { streamId, lastEventId } = reply.conv.pending;
  const seq = lastEventId ? lastEventId.slice(lastEventId.lastIndexOf(':') + 1) : null;
  const path = `/v1/streams/${encodeURIComponent(streamId)}${seq === null ? '' : `?after=${encodeURIComponent(seq)}`}`;
  const { response } = await client.request('GET', path, undefined, { signal: reply.controller.signal });
  return response;
}

/** Read the stream to [DONE]; a broken connection is resumed (same run, no second prefill). */
export async function follow(reply, response, client) {
  let brokeAt = null;
  for (let attempt = 0; ; attempt++) {
    try {
      if (!response) {
        response = await reopen(reply, client);
        brokeAt = null;
        attempt = 0;
        reply.hooks.onConnection('connected');
      }
      if (await readEvents(reply, response)) return;
      throw new APIConnectionError('the stream ended early');
    } catch (err) {
      if (reply.stopped || !reply.conv.pending?.streamId || !brokenConnection(err)) throw err;
      brokeAt ??= Date.now();
      if (Date.now() - brokeAt > RESUME_FOR_MS) throw err;
      reply.hooks.onConnection('reconnecting');
      response = null;
      await new Promise((r) => setTimeout(r, BACKOFF_MS[Math.min(attempt, BACKOFF_MS.length - 1)]));
    }
  }
}
