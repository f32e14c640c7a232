/** WebSocket client for `/v1/ws` (subprotocol `pagedserve.v1`): many generations on one socket.
 * Uses the global WebSocket (browsers, Deno, Bun, Node >= 22) or the optional `ws` package (Node 20).
 * On close codes 1001/1011/1012/1013 it reconnects with backoff; generations running on the old
 * socket end with APIConnectionError, since the server aborted them when the socket closed,
 * except resumable ones (`resumable: true`): those are resumed on the new socket after their last
 * delta (also after a plain network drop, code 1006). */

import { APIConnectionError, PagedServeError, streamError } from './errors.js';
import { retryDelayMs, sleep } from './retry.js';
import type { ChatCompletionChunk, ChatCompletionParams, GenerationDone } from './types.js';
import { chunkText } from './types.js';

export const SUBPROTOCOL = 'pagedserve.v1';
export const RECONNECT_CODES: ReadonlySet<number> = new Set([1001, 1011, 1012, 1013]);
/** A normal close and a policy refusal (bad key, origin): nothing to resume after them. */
export const NO_RESUME_CODES: ReadonlySet<number> = new Set([1000, 1008]);

/** The part of the WHATWG WebSocket this client uses (the `ws` package has it too). */
export interface WebSocketLike {
  readonly readyState: number;
  send(data: string): void;
  close(code?: number, reason?: string): void;
  addEventListener(type: string, listener: (event: any) => void): void;
}
export type WebSocketConstructor = new (url: string, protocols?: string | string[]) => WebSocketLike;

export interface WebSocketOptions {
  /** Sent as the `bearer.<key>` subprotocol, since browsers cannot set headers on WebSockets. */
  apiKey?: string | null;
  WebSocket?: WebSocketConstructor;
  reconnect?: boolean;
  maxReconnectAttempts?: number;
}

type Item = { chunk: ChatCompletionChunk } | { done: GenerationDone } | { error: PagedServeError };

/** One generation's chunks as an AsyncIterable; `break` (or the signal) cancels it on the server. */
export class Generation implements AsyncIterable<ChatCompletionChunk> {
  requestId: string | null = null;
  /** Set when the server made it resumable. */
  streamId: string | null = null;
  /** The last delta's seq: where a resume continues. */
  lastSeq = -1;
  done: GenerationDone | null = null;
  private readonly items: Item[] = [];
  private wake: (() => void) | null = null;
  private ended = false;

  constructor(readonly id: string, private readonly client: WebSocketClient) {}

  async *[Symbol.asyncIterator](): AsyncIterator<ChatCompletionChunk> {
    try {
      for (;;) {
        while (this.items.length === 0) await new Promise<void>((resolve) => { this.wake = resolve; });
        const item = this.items.shift()!;
        if ('chunk' in item) yield item.chunk;
        else if ('error' in item) throw item.error;
        else return;
      }
    } finally {
      if (!this.ended) this.cancel();
    }
  }

  /** Ask the server to stop; the generation then ends with status `cancelled`. */
  cancel(): void {
    if (!this.ended) this.client.cancel(this.id);
  }

  /** Consume the generation and return all its text. */
  async text(): Promise<string> {
    let text = '';
    for await (const chunk of this) text += chunkText(chunk);
    return text;
  }

  /** @internal */
  push(item: Item): void {
    if (!('chunk' in item)) this.ended = true;
    this.items.push(item);
    this.wake?.();
    this.wake = null;
  }
}

export class WebSocketClient {
  sessionId: string | null = null;
  model: string | null = null;
  draining = false;
  reconnects = 0;
  private socket: Promise<WebSocketLike> | null = null;
  private closing = false;
  private nextId = 1;
  private readonly generations = new Map<string, Generation>();

  constructor(readonly url: string, private readonly options: WebSocketOptions = {}) {}

  /** Open the socket (generate() does it on first use). */
  async connect(): Promise<void> {
    this.socket ??= this.open();
    await this.socket;
  }

  /** Start a generation; iterate it for chunks. */
  async generate(params: ChatCompletionParams, options: { id?: string; signal?: AbortSignal } = {}): Promise<Generation> {
    const ws = await this.ready();
    const id = options.id ?? `g${this.nextId++}`;
    const gen = new Generation(id, this);
    this.generations.set(id, gen);
    options.signal?.addEventListener('abort', () => gen.cancel(), { once: true });
    ws.send(JSON.stringify({ type: 'generate', id, request: params }));
    return gen;
  }

  cancel(id: string): void {
    void this.ready().then((ws) => ws.send(JSON.stringify({ type: 'cancel', id })), () => undefined);
  }

  close(): void {
    this.closing = true;
    void this.socket?.then((ws) => ws.close(1000), () => undefined);
    this.failAll(new APIConnectionError('the WebSocket client was closed'));
  }

  private async ready(): Promise<WebSocketLike> {
    if (this.closing) throw new APIConnectionError('the WebSocket client is closed');
    this.socket ??= this.open();
    return this.socket;
  }

  private async open(): Promise<WebSocketLike> {
    const Ctor = this.options.WebSocket ?? (globalThis as { WebSocket?: WebSocketConstructor }).WebSocket ?? (await loadWs());
    const protocols = [SUBPROTOCOL];
    if (this.options.apiKey) protocols.push(`bearer.${this.options.apiKey}`);
    const ws = new Ctor(this.url, protocols);
    // NOTE: listen before `open` resolves: `ws` may deliver a first frame in the same tick.
    ws.addEventListener('message', (event: { data: unknown }) => this.dispatch(JSON.parse(String(event.data))));
    let opened = false;
    ws.addEventListener('close', (event: { code: number }) => void (opened && this.onClose(event.code)));
    await new Promise<void>((resolve, reject) => {
      ws.addEventListener('open', () => { opened = true; resolve(); });
      ws.addEventListener('close', (event: { code: number }) => reject(new APIConnectionError(`WebSocket connect failed (code ${event.code})`)));
      ws.addEventListener('error', () => reject(new APIConnectionError('WebSocket connect failed')));
    });
    return ws;
  }

  private async onClose(code: number): Promise<void> {
    const reconnect = (this.options.reconnect ?? true) && !this.closing;
    const resumable = reconnect && !NO_RESUME_CODES.has(code);
    this.failAll(new APIConnectionError(`WebSocket closed (code ${code})`), resumable);
    if (this.closing) return;
    if (!reconnect || !(RECONNECT_CODES.has(code) || (resumable && this.generations.size > 0))) {
      this.socket = Promise.reject(new APIConnectionError(`WebSocket closed (code ${code})`));
      this.socket.catch(() => undefined);
      return;
    }
    this.socket = this.reconnect();
    this.socket.then((ws) => this.resumeAll(ws), (err) => this.failAll(err));
  }

  private resumeAll(ws: WebSocketLike): void {
    for (const gen of this.generations.values()) {
      ws.send(JSON.stringify({ type: 'resume', id: gen.id, stream_id: gen.streamId, after_seq: gen.lastSeq }));
    }
  }

  private async reconnect(): Promise<WebSocketLike> {
    const attempts = this.options.maxReconnectAttempts ?? 5;
    for (let attempt = 0; ; attempt++) {
      await sleep(retryDelayMs(attempt));
      try {
        const ws = await this.open();
        this.reconnects++;
        return ws;
      } catch (err) {
        if (attempt + 1 >= attempts || this.closing) throw err;
      }
    }
  }

  private dispatch(frame: Record<string, any>): void {
    const gen = this.generations.get(frame.id);
    switch (frame.type) {
      case 'session.created':
        this.sessionId = frame.session_id ?? null;
        this.model = frame.model ?? null;
        this.draining = false;
        return;
      case 'session.draining':
        this.draining = true;
        return;
    }
    if (!gen) return; // NOTE: pong, or a frame for a generation already ended
    if (frame.type === 'generation.started') {
      gen.requestId = frame.request_id ?? null;
      gen.streamId = frame.stream_id ?? null;
    } else if (frame.type === 'generation.delta') {
      gen.lastSeq = frame.seq ?? gen.lastSeq;
      gen.push({ chunk: frame.chunk });
    }
    else if (frame.type === 'generation.done') {
      gen.done = frame as unknown as GenerationDone;
      this.end(gen, { done: gen.done });
    } else if (frame.type === 'error') this.end(gen, { error: streamError(frame, gen.requestId) });
  }

  private end(gen: Generation, item: Item): void {
    this.generations.delete(gen.id);
    gen.push(item);
  }

  private failAll(error: PagedServeError, keepResumable = false): void {
    for (const gen of [...this.generations.values()]) {
      if (!(keepResumable && gen.streamId !== null)) this.end(gen, { error });
    }
  }
}

async function loadWs(): Promise<WebSocketConstructor> {
  // NOTE: a variable specifier keeps bundlers and tsc from resolving `ws` for browser builds.
  const name = 'ws';
  try {
    const mod = await import(/* @vite-ignore */ name);
    return (mod.WebSocket ?? mod.default) as WebSocketConstructor;
  } catch (err) {
    throw new APIConnectionError('no global WebSocket: on Node 20 install the `ws` package', { cause: err });
  }
}
