import { describe, expect, it } from 'vitest';
import { iterEvents, SSEDecoder, type ServerSentEvent } from '../src/index.js';

const STREAM = new TextEncoder().encode(
  ': ping\n\n' +
  'data: {"text": "h\u00e9llo \u4e16\u754c \u{1F600}"}\n\n' +
  'event: error\r\ndata: line one\r\ndata: line two\r\n\r\n' +
  'id: 7\rretry: 50\rdata:no-space\r\r' +
  'data: [DONE]\n\n' +
  'data: unfinished',
);

const ev = (data: string, extra: Partial<ServerSentEvent> = {}): ServerSentEvent =>
  ({ data, event: null, id: null, retry: null, ...extra });

const EXPECTED = [
  ev('{"text": "h\u00e9llo \u4e16\u754c \u{1F600}"}'),
  ev('line one\nline two', { event: 'error' }),
  ev('no-space', { id: '7', retry: 50 }),
  ev('[DONE]', { id: '7' }),
];

function parse(parts: Uint8Array[]): ServerSentEvent[] {
  const decoder = new SSEDecoder();
  return parts.flatMap((p) => decoder.feed(p));
}

function byteStream(parts: Uint8Array[]): ReadableStream<Uint8Array> {
  return new ReadableStream({
    start(controller) {
      for (const p of parts) controller.enqueue(p);
      controller.close();
    },
  });
}

describe('SSEDecoder', () => {
  it('parses a whole stream', () => {
    expect(parse([STREAM])).toEqual(EXPECTED);
  });

  it('parses the stream split at every offset (inside multi-byte characters too)', async () => {
    for (let i = 0; i <= STREAM.length; i++) {
      const parts = [STREAM.slice(0, i), STREAM.slice(i)];
      expect(parse(parts), `split at ${i}`).toEqual(EXPECTED);
      const events: ServerSentEvent[] = [];
      for await (const e of iterEvents(byteStream(parts))) events.push(e);
      expect(events, `stream split at ${i}`).toEqual(EXPECTED);
    }
  });

  it('parses the stream one byte at a time', () => {
    expect(parse([...STREAM].map((b) => Uint8Array.of(b)))).toEqual(EXPECTED);
  });

  it('ignores comments and empty events', () => {
    expect(parse([new TextEncoder().encode(': a comment\n\n\n:another\n\n')])).toEqual([]);
  });
});
