import OpenAI from 'openai';
import { afterEach, beforeEach, describe, expect, inject, it } from 'vitest';
import { WebSocket } from 'ws';
import * as ps from '../src/index.js';
import { CuttingProxy, waitIdle } from './helpers.js';

const baseURL = inject('baseURL');
const MESSAGES = [{ role: 'user' as const, content: 'Tell a long story' }];
const ENGINE = 'model_name="tiny-llama"';
const Ctor = WebSocket as unknown as ps.WebSocketConstructor;

async function counter(name: string): Promise<number> {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  const match = text.match(new RegExp(`^${name.replace(/[{}]/g, '\\$&')} (\\S+)$`, 'm'));
  return match ? Number(match[1]) : 0;
}

async function reference(maxTokens: number): Promise<string> {
  const stream = await new ps.PagedServe({ baseURL }).chat.completions.create({
    messages: MESSAGES, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true,
  });
  let text = '';
  for await (const chunk of stream) text += ps.chunkText(chunk);
  return text;
}

describe('resumable streams survive a network cut', () => {
  let proxy: CuttingProxy;
  beforeEach(async () => { proxy = await CuttingProxy.start(Number(new URL(baseURL).port)); });
  afterEach(async () => { await proxy.close(); });

  it('an SSE stream resumes with Last-Event-ID: the same text, one prefill', async () => {
    // NOTE: long enough that events are still coming when the network is cut
    const expected = await reference(300);
    expect(await waitIdle(baseURL)).toBe(0);
    const prompt0 = await counter(`vllm:prompt_tokens_total{${ENGINE}}`);
    const generated0 = await counter(`vllm:generation_tokens_total{${ENGINE}}`);
    const client = new ps.PagedServe({ baseURL: proxy.url });
    const stream = await client.chat.completions.create({
      messages: MESSAGES, max_tokens: 300, temperature: 0, ignore_eos: true, stream: true,
      resumable: true, cache_salt: `ts-${Date.now()}-${Math.random()}`,
      stream_options: { include_usage: true },
    });
    let text = '';
    let n = 0;
    let usage: ps.Usage | null | undefined = null;
    for await (const chunk of stream) {
      text += ps.chunkText(chunk);
      usage = chunk.usage ?? usage;
      if (++n === 5) proxy.cut(2000);
    }
    expect(text).toBe(expected);
    expect([proxy.cuts, stream.resumes >= 1, stream.lastEventId?.startsWith(`${stream.streamId}:`)])
      .toEqual([1, true, true]);
    const deadline = Date.now() + 30_000;
    while (await counter(`vllm:generation_tokens_total{${ENGINE}}`) < generated0 + 300 && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 100));
    }
    expect(await counter(`vllm:prompt_tokens_total{${ENGINE}}`) - prompt0).toBe(usage?.prompt_tokens);
    expect(await counter(`vllm:generation_tokens_total{${ENGINE}}`) - generated0).toBe(300);
  });

  it('a WebSocket generation resumes on a new socket', async () => {
    // NOTE: long enough that deltas are still coming when the network is cut
    const expected = await reference(300);
    const ws = new ps.PagedServe({ baseURL: proxy.url }).websocket({ WebSocket: Ctor });
    try {
      const gen = await ws.generate({ messages: MESSAGES, max_tokens: 300, temperature: 0, ignore_eos: true, resumable: true });
      let text = '';
      let n = 0;
      for await (const chunk of gen) {
        text += ps.chunkText(chunk);
        if (++n === 3) proxy.cut(2000);
      }
      expect(text).toBe(expected);
      expect([gen.streamId !== null, ws.reconnects, gen.done?.status]).toEqual([true, 1, 'completed']);
    } finally {
      ws.close();
    }
  });

  it('the openai package reads a resumable stream (its id: lines)', async () => {
    const expected = await reference(24);
    const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'sk-test' });
    const stream = await openai.chat.completions.create({
      model: 'tiny-llama', messages: MESSAGES, max_tokens: 24, temperature: 0, stream: true,
      resumable: true, ignore_eos: true, // pagedserve's and vLLM's extra fields
    } as OpenAI.ChatCompletionCreateParamsStreaming);
    let text = '';
    for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
    expect(text).toBe(expected);
  });

  it('a resumable Responses stream (no [DONE]) ends at its terminal event and resumes across a cut', async () => {
    const params = { input: 'Tell a long story', max_output_tokens: 300, temperature: 0, ignore_eos: true, store: false };
    const deltas = (events: ps.ResponseStreamEvent[]) =>
      events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('');
    const plain: ps.ResponseStreamEvent[] = [];
    for await (const e of await new ps.PagedServe({ baseURL }).responses.create({ ...params, stream: true })) plain.push(e);
    // NOTE: read to its end without a cut: no reconnect (its body ends after response.incomplete)
    const whole = await new ps.PagedServe({ baseURL }).responses.create({ ...params, max_output_tokens: 8, stream: true, resumable: true });
    const kinds: string[] = [];
    for await (const e of whole) kinds.push(e.type);
    expect([whole.streamId !== null, whole.resumes, kinds.at(-1)]).toEqual([true, 0, 'response.incomplete']);
    const stream = await new ps.PagedServe({ baseURL: proxy.url }).responses.create({ ...params, stream: true, resumable: true });
    const seen: ps.ResponseStreamEvent[] = [];
    for await (const e of stream) {
      seen.push(e);
      if (seen.length === 5) proxy.cut(2000);
    }
    expect([proxy.cuts, stream.resumes >= 1]).toEqual([1, true]);
    expect(seen.map((e) => e.sequence_number)).toEqual(seen.map((_, k) => k));
    expect(seen.filter((e) => ps.TERMINAL_EVENTS.has(e.type)).map((e) => e.type)).toEqual(['response.incomplete']);
    expect(deltas(seen)).toBe(deltas(plain));
    expect(deltas(plain).length).toBeGreaterThan(0);
  });

  it('leaving a resumable stream early cancels it on the server', async () => {
    const expired0 = await counter('pagedserve_streams_expired_aborted_total');
    const stream = await new ps.PagedServe({ baseURL }).chat.completions.create({
      messages: MESSAGES, max_tokens: 3000, ignore_eos: true, stream: true, resumable: true,
    });
    let n = 0;
    for await (const _ of stream) if (++n === 2) break;
    // NOTE: well inside the 30 s grace period: the DELETE stopped it, not the expiry
    expect(await waitIdle(baseURL, 15_000)).toBe(0);
    expect(await counter('pagedserve_streams_expired_aborted_total')).toBe(expired0);
  });
});
