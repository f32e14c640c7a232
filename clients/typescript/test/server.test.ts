import OpenAI from 'openai';
import { describe, expect, inject, it } from 'vitest';
import * as ps from '../src/index.js';
import { waitIdle, waitMetric } from './helpers.js';

const baseURL = inject('baseURL');
const MESSAGES = [{ role: 'user', content: 'Tell me a story.' }];
const LONG = { max_tokens: 3000, ignore_eos: true };

describe('PagedServe against a real server', () => {
  const client = new ps.PagedServe({ baseURL });

  it('lists models, answers JSON and streams the same text', async () => {
    const models = await client.models.list();
    expect(models.data[0].id).toBe('tiny-llama');
    const reply = await client.chat.completions.create({ messages: MESSAGES, max_tokens: 5, ignore_eos: true, temperature: 0 });
    expect(reply.choices[0].finish_reason).toBe('length');
    expect(reply.usage?.completion_tokens).toBe(5);
    const stream = await client.chat.completions.create({
      messages: MESSAGES, max_tokens: 5, ignore_eos: true, temperature: 0, stream: true,
      stream_options: { include_usage: true },
    });
    const chunks: ps.ChatCompletionChunk[] = [];
    for await (const chunk of stream) chunks.push(chunk);
    expect(stream.requestId).toBeTruthy();
    expect(chunks[0].choices[0].delta.role).toBe('assistant');
    expect(chunks.map(ps.chunkText).join('')).toBe(reply.choices[0].message.content);
    expect(chunks.at(-1)?.usage?.completion_tokens).toBe(5);
  });

  it('retrieves the model, tokenizes and answers several choices and prompts', async () => {
    expect((await client.models.retrieve('tiny-llama')).id).toBe('tiny-llama');
    await expect(client.models.retrieve('nope')).rejects.toBeInstanceOf(ps.NotFoundError);
    const tokens = await client.tokenize({ prompt: 'Hello world' });
    expect(tokens.count).toBe(tokens.tokens.length);
    expect(await client.detokenize(tokens.tokens)).toBe('Hello world');
    const reply = await client.completions.create({ prompt: ['a', 'b'], n: 2, max_tokens: 2, temperature: 0 });
    expect(reply.choices.map((c) => c.index)).toEqual([0, 1, 2, 3]);
    expect(reply.usage?.completion_tokens).toBe(8);
  });

  it('cancels a stream on break', async () => {
    const stream = await client.completions.create({ prompt: 'Once', stream: true, ...LONG });
    let n = 0;
    for await (const _ of stream) {
      if (++n === 3) break;
    }
    expect(n).toBe(3);
    expect(await waitIdle(baseURL)).toBe(0);
  });

  it('cancels a stream through an AbortSignal', async () => {
    const controller = new AbortController();
    const stream = await client.chat.completions.create({ messages: MESSAGES, stream: true, ...LONG }, { signal: controller.signal });
    let aborted = false;
    const err = await (async () => {
      for await (const _ of stream) {
        // NOTE: once, at the first chunk: chunks already buffered still arrive after abort()
        // (the request is gone by then). Polled: the first chunk (the role's) can arrive
        // before the engine's stats count the request.
        if (aborted) continue;
        expect(await waitMetric(baseURL, 'pagedserve_requests_running', 1)).toBe(1);
        controller.abort();
        aborted = true;
      }
    })().catch((e) => e);
    expect(err).toBeInstanceOf(ps.APIUserAbortError);
    expect(await waitIdle(baseURL, 30000)).toBe(0);
  });

  it('throws typed errors', async () => {
    const bad = await client.chat.completions.create({ messages: MESSAGES, max_tokens: 0 }).catch((e) => e);
    expect(bad).toBeInstanceOf(ps.BadRequestError);
    expect([bad.status, bad.code, bad.param]).toEqual([400, 'invalid_value', 'max_tokens']);
    const missing = await client.chat.completions.create({ messages: MESSAGES, model: 'nope' }).catch((e) => e);
    expect(missing).toBeInstanceOf(ps.NotFoundError);
    expect(missing.code).toBe('model_not_found');
    const down = new ps.PagedServe({ baseURL: 'http://127.0.0.1:9', maxRetries: 0 });
    await expect(down.models.list()).rejects.toBeInstanceOf(ps.APIConnectionError);
  });
});

describe('WebSocketClient against a real server (ws package on Node 20)', () => {
  it('runs several generations on one socket, cancels one, reports errors', async () => {
    // NOTE: no constructor given: on Node 20 the SDK loads the optional `ws` package itself.
    const ws = new ps.PagedServe({ baseURL }).websocket();
    try {
      const short = await Promise.all([1, 2, 3].map(() => ws.generate({ messages: MESSAGES, max_tokens: 8, ignore_eos: true })));
      const long = await ws.generate({ messages: MESSAGES, ...LONG });
      const texts = await Promise.all(short.map((g) => g.text()));
      expect(texts.every((t) => t.length > 0)).toBe(true);
      expect(short.map((g) => g.done?.usage?.completion_tokens)).toEqual([8, 8, 8]);
      for await (const _ of long) break; // NOTE: break cancels on the server
      const bad = await ws.generate({ messages: MESSAGES, max_tokens: 0 });
      const err = await bad.text().catch((e) => e);
      expect(err).toBeInstanceOf(ps.StreamError);
      expect(err.code).toBe('invalid_value');
      expect(ws.sessionId).toMatch(/^sess-/);
      expect(await waitIdle(baseURL)).toBe(0);
    } finally {
      ws.close();
    }
  });
});

describe('official openai npm package (conformance)', () => {
  const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'none', maxRetries: 0 });

  it('lists models', async () => {
    const models = await openai.models.list();
    expect(models.data.map((m) => m.id)).toEqual(['tiny-llama']);
  });

  it('streams a chat completion with usage', async () => {
    // NOTE: a variable, not a literal: vLLM-style extras (ignore_eos) are not in openai's types.
    const params = {
      model: 'tiny-llama', messages: [{ role: 'user' as const, content: 'hi' }], max_tokens: 6,
      stream: true as const, stream_options: { include_usage: true }, ignore_eos: true,
    };
    const stream = await openai.chat.completions.create(params);
    let text = '';
    let usage: OpenAI.CompletionUsage | null | undefined;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta?.content ?? '';
      usage = chunk.usage ?? usage;
    }
    expect(text.length).toBeGreaterThan(0);
    expect(usage?.completion_tokens).toBe(6);
  });

  it('surfaces a 400 as BadRequestError', async () => {
    const err = await openai.chat.completions.create({ model: 'tiny-llama', messages: [{ role: 'user', content: 'hi' }], temperature: -1 }).catch((e) => e);
    expect(err).toBeInstanceOf(OpenAI.BadRequestError);
    expect(err.status).toBe(400);
    expect(err.code).toBe('invalid_value');
  });
});
