import { describe, expect, it } from 'vitest';
import * as ps from '../src/index.js';

const CHAT = { messages: [{ role: 'user', content: 'hi' }] };
const OK = { id: 'r1', object: 'chat.completion', created: 0, model: 'm', future_field: 1,
  choices: [{ index: 0, message: { role: 'assistant', content: 'yo' }, finish_reason: 'stop' }] };

function errorResponse(status: number, code: string, headers: Record<string, string> = {}): Response {
  const body = { error: { message: `boom ${status}`, type: 't', param: 'p', code } };
  return new Response(JSON.stringify(body), { status, headers: { 'x-request-id': 'req-9', ...headers } });
}

function scripted(responses: (Response | Error)[]) {
  const seen: Request[] = [];
  const fetchImpl = (async (input: RequestInfo | URL, init?: RequestInit) => {
    seen.push(new Request(input, init));
    const next = responses.shift()!;
    if (next instanceof Error) throw next;
    return next;
  }) as typeof fetch;
  return { seen, client: new ps.PagedServe({ baseURL: 'http://test/v1', apiKey: 'k', fetch: fetchImpl }) };
}

describe('retries and errors', () => {
  it.each([408, 409, 429, 500, 503])('retries %i then succeeds', async (status) => {
    const { seen, client } = scripted([errorResponse(status, 'x', { 'retry-after': '0.01' }), Response.json(OK)]);
    const reply = await client.chat.completions.create(CHAT);
    expect(reply.choices[0].message.content).toBe('yo');
    expect(seen.length).toBe(2);
    expect(seen[0].url).toBe('http://test/v1/chat/completions');
    expect(seen[0].headers.get('authorization')).toBe('Bearer k');
  });

  it.each([
    [400, ps.BadRequestError], [401, ps.AuthenticationError], [403, ps.PermissionDeniedError],
    [404, ps.NotFoundError], [413, ps.RequestTooLargeError], [422, ps.UnprocessableEntityError],
  ] as const)('types %i and does not retry it', async (status, Cls) => {
    const { seen, client } = scripted([errorResponse(status, 'bad_thing')]);
    const err = await client.chat.completions.create(CHAT).catch((e) => e);
    expect(err).toBeInstanceOf(Cls);
    expect(err).toBeInstanceOf(ps.APIStatusError);
    expect([err.status, err.code, err.param, err.type, err.requestId, err.message])
      .toEqual([status, 'bad_thing', 'p', 't', 'req-9', `boom ${status}`]);
    expect(seen.length).toBe(1);
  });

  it('gives up after maxRetries', async () => {
    const { seen, client } = scripted([1, 2, 3].map(() => errorResponse(503, 'overloaded', { 'retry-after-ms': '5' })));
    const err = await client.models.list().catch((e) => e);
    expect(err).toBeInstanceOf(ps.ServiceUnavailableError);
    expect(err).toBeInstanceOf(ps.InternalServerError);
    expect(seen.length).toBe(3);
  });

  it('retries network errors, then throws APIConnectionError', async () => {
    const { seen, client } = scripted([1, 2, 3].map(() => new TypeError('fetch failed')));
    await expect(client.models.list()).rejects.toBeInstanceOf(ps.APIConnectionError);
    expect(seen.length).toBe(3);
  });

  it('raises an in-stream error event and never retries a consumed stream', async () => {
    const sse = 'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n' +
      'data: {"error":{"message":"engine died","type":"server_error","param":null,"code":"engine_error"}}\n\ndata: [DONE]\n\n';
    const { seen, client } = scripted([new Response(sse, { headers: { 'x-request-id': 'c1' } })]);
    const stream = await client.chat.completions.create({ ...CHAT, stream: true });
    const texts: string[] = [];
    const err = await (async () => { for await (const c of stream) texts.push(ps.chunkText(c)); })().catch((e) => e);
    expect(texts).toEqual(['a']);
    expect(err).toBeInstanceOf(ps.StreamError);
    expect([err.code, err.requestId]).toEqual(['engine_error', 'c1']);
    expect(seen.length).toBe(1);
  });

  it('ends a stream at [DONE] and skips comments', async () => {
    const sse = ': keep-alive\n\ndata: {"id":"c","choices":[{"index":0,"text":"x"}]}\n\ndata: [DONE]\n\ndata: {junk\n\n';
    const { client } = scripted([new Response(sse)]);
    const texts: string[] = [];
    for await (const c of await client.completions.create({ prompt: 'p', stream: true })) texts.push(ps.chunkText(c));
    expect(texts).toEqual(['x']);
  });

  it('honours Retry-After and backs off otherwise', () => {
    expect(ps.retryDelayMs(0, new Headers({ 'retry-after': '3' }))).toBe(3000);
    expect(ps.retryDelayMs(0, new Headers({ 'retry-after-ms': '250' }))).toBe(250);
    const zero = ps.retryDelayMs(0, new Headers({ 'retry-after': '0' }));
    expect(zero).toBeGreaterThanOrEqual(375);
    expect(zero).toBeLessThanOrEqual(500);
    expect(ps.retryDelayMs(10)).toBeLessThanOrEqual(8000);
    expect(ps.shouldRetry(400)).toBe(false);
    expect(ps.shouldRetry(502)).toBe(true);
  });
});
