import OpenAI from 'openai';
import { describe, expect, inject, it } from 'vitest';
import * as ps from '../src/index.js';
import { metric, waitIdle } from './helpers.js';

const baseURL = inject('baseURL');
const WEATHER = {
  type: 'function' as const, name: 'get_weather', description: 'Weather of a city',
  parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'], additionalProperties: false },
};

describe('responses.create against a real server', () => {
  const client = new ps.PagedServe({ baseURL, maxRetries: 0 });
  const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'none', maxRetries: 0 });

  it('answers as the openai SDK reads it, streamed and not', async () => {
    const params = { input: 'Hi there', max_output_tokens: 5, temperature: 0, ignore_eos: true };
    const reply = await client.responses.create(params);
    const reference = await openai.responses.create({ ...params, model: 'tiny-llama' } as OpenAI.Responses.ResponseCreateParamsNonStreaming);
    expect(reply.status).toBe('incomplete');
    expect(reply.incomplete_details?.reason).toBe('max_output_tokens');
    expect(ps.outputText(reply)).toBe(reference.output_text);
    expect(reply.usage?.input_tokens).toBe(reference.usage?.input_tokens);
    const stream = await client.responses.create({ ...params, stream: true });
    const events: ps.ResponseStreamEvent[] = [];
    for await (const event of stream) events.push(event);
    expect(events.map((e) => e.sequence_number)).toEqual(events.map((_, i) => i));
    expect(events[0].type).toBe('response.created');
    expect(events.at(-1)?.type).toBe('response.incomplete');
    expect(events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('')).toBe(reference.output_text);
    expect(stream.requestId).toBe(events[0].response?.id);
  });

  it('calls a tool, stores, retrieves and deletes', async () => {
    const reply = await client.responses.create({ input: 'Weather?', tools: [WEATHER], tool_choice: 'required', max_output_tokens: 80, temperature: 0 });
    const [call] = reply.output;
    expect(call.type).toBe('function_call');
    expect(call.name).toBe('get_weather');
    expect(typeof JSON.parse(call.arguments ?? '').city).toBe('string');
    expect((await client.responses.retrieve(reply.id)).output).toEqual(reply.output);
    expect((await client.responses.delete(reply.id)).deleted).toBe(true);
    await expect(client.responses.retrieve(reply.id)).rejects.toBeInstanceOf(ps.NotFoundError);
    await expect(client.responses.create({ input: 'x', background: true })).rejects.toBeInstanceOf(ps.BadRequestError);
  });

  it('cancels a stream on break', async () => {
    const stream = await client.responses.create({ input: 'Once', stream: true, max_output_tokens: 3000, ignore_eos: true });
    let deltas = 0;
    for await (const event of stream) {
      if (event.type === 'response.output_text.delta' && ++deltas === 3) {
        expect(await metric(baseURL, 'pagedserve_requests_running')).toBe(1);
        break;
      }
    }
    expect(await waitIdle(baseURL)).toBe(0);
  });
});
