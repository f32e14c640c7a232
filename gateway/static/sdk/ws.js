/** WebSocket client for `/v1/ws` (subprotocol `pagedserve.v1`): many generations on one socket.
 * Uses the global WebSocket (browsers, Deno, Bun, Node >= 22) or the optional `ws` package (Node 20).
 * On close codes 1001/1011/1012/1013 it reconnects with backoff; generations running on the old
 * socket end with APIConnectionError, since the server aborted them when the socket closed,
 * except resumable ones (`resumable: true`): those are resumed on the new socket after their last
 * delta (also after a plain network drop, code 1006). */
import { APIConnectionError, streamError } from './errors.js';
import { retryDelayMs, sleep } from './retry.js';
import { chunkText } from './types.js';
export const SUBPROTOCOL = 'pagedserve.v1';
export const RECONNECT_CODES = new Set([1001, 1011, 1012, 1013]);
/** A normal close and a policy refusal (bad key, origin): nothing to resume after them. */
export const NO_RESUME_CODES = new Set([1000, 1008]);
/** One generation's chunks as an AsyncIterable; `break` (or the signal) cancels it on the server. */
export class Generation {
    id;
    client;
    requestId = null;
    /** Set when the server made it resumable. */
    streamId = null;
    /** The last delta's seq: where a resume continues. */
    lastSeq = -1;
    done = null;
    items = [];
    wake = null;
    ended = false;
    constructor(id, client) {
        this.id = id;
        this.client = client;
    }
    async *[Symbol.asyncIterator]() {
        try {
            for (;;) {
                while (this.items.length === 0)
                    await new Promise((resolve) => { this.wake = resolve; });
                const item = this.items.shift();
                if ('chunk' in item)
                    yield item.chunk;
                else if ('error' in item)
                    throw item.error;
                else
                    return;
            }
        }
        finally {
            if (!this.ended)
                this.cancel();
        }
    }
    /** Ask the server to stop; the generation then ends with status `cancelled`. */
    cancel() {
        if (!this.ended)
            this.client.cancel(this.id);
    }
    /** Consume the generation and return all its text. */
    async text() {
        let text = '';
        for await (const chunk of this)
            text += chunkText(chunk);
        return text;
    }
    /** @internal */
    push(item) {
        if (!('chunk' in item))
            this.ended = true;
        this.items.push(item);
        this.wake?.();
        this.wake = null;
    }
}
export class WebSocketClient {
    url;
    options;
    sessionId = null;
    model = null;
    draining = false;
    reconnects = 0;
    socket = null;
    closing = false;
    nextId = 1;
    generations = new Map();
    constructor(url, options = {}) {
        this.url = url;
        this.options = options;
    }
    /** Open the socket (generate() does it on first use). */
    async connect() {
        this.socket ??= this.open();
        await this.socket;
    }
    /** Start a generation; iterate it for chunks. */
    async generate(params, options = {}) {
        const ws = await this.ready();
        const id = options.id ?? `g${this.nextId++}`;
        const gen = new Generation(id, this);
        this.generations.set(id, gen);
        options.signal?.addEventListener('abort', () => gen.cancel(), { once: true });
        ws.send(JSON.stringify({ type: 'generate', id, request: params }));
        return gen;
    }
    cancel(id) {
        void this.ready().then((ws) => ws.send(JSON.stringify({ type: 'cancel', id })), () => undefined);
    }
    close() {
        this.closing = true;
        void this.socket?.then((ws) => ws.close(1000), () => undefined);
        this.failAll(new APIConnectionError('the WebSocket client was closed'));
    }
    async ready() {
        if (this.closing)
            throw new APIConnectionError('the WebSocket client is closed');
        this.socket ??= this.open();
        return this.socket;
    }
    async open() {
        const Ctor = this.options.WebSocket ?? globalThis.WebSocket ?? (await loadWs());
        const protocols = [SUBPROTOCOL];
        if (this.options.apiKey)
            protocols.push(`bearer.${this.options.apiKey}`);
        const ws = new Ctor(this.url, protocols);
        // NOTE: listen before `open` resolves: `ws` may deliver a first frame in the same tick.
        ws.addEventListener('message', (event) => this.dispatch(JSON.parse(String(event.data))));
        let opened = false;
        ws.addEventListener('close', (event) => void (opened && this.onClose(event.code)));
        await new Promise((resolve, reject) => {
            ws.addEventListener('open', () => { opened = true; resolve(); });
            ws.addEventListener('close', (event) => reject(new APIConnectionError(`WebSocket connect failed (code ${event.code})`)));
            ws.addEventListener('error', () => reject(new APIConnectionError('WebSocket connect failed')));
        });
        return ws;
    }
    async onClose(code) {
        const reconnect = (this.options.reconnect ?? true) && !this.closing;
        const resumable = reconnect && !NO_RESUME_CODES.has(code);
        this.failAll(new APIConnectionError(`WebSocket closed (code ${code})`), resumable);
        if (this.closing)
            return;
        if (!reconnect || !(RECONNECT_CODES.has(code) || (resumable && this.generations.size > 0))) {
            this.socket = Promise.reject(new APIConnectionError(`WebSocket closed (code ${code})`));
            this.socket.catch(() => undefined);
            return;
        }
        this.socket = this.reconnect();
        this.socket.then((ws) => this.resumeAll(ws), (err) => this.failAll(err));
    }
    resumeAll(ws) {
        for (const gen of this.generations.values()) {
            ws.send(JSON.stringify({ type: 'resume', id: gen.id, stream_id: gen.streamId, after_seq: gen.lastSeq }));
        }
    }
    async reconnect() {
        const attempts = this.options.maxReconnectAttempts ?? 5;
        for (let attempt = 0;; attempt++) {
            await sleep(retryDelayMs(attempt));
            try {
                const ws = await this.open();
                this.reconnects++;
                return ws;
            }
            catch (err) {
                if (attempt + 1 >= attempts || this.closing)
                    throw err;
            }
        }
    }
    dispatch(frame) {
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
        if (!gen)
            return; // NOTE: pong, or a frame for a generation already ended
        if (frame.type === 'generation.started') {
            gen.requestId = frame.request_id ?? null;
            gen.streamId = frame.stream_id ?? null;
        }
        else if (frame.type === 'generation.delta') {
            gen.lastSeq = frame.seq ?? gen.lastSeq;
            gen.push({ chunk: frame.chunk });
        }
        else if (frame.type === 'generation.done') {
            gen.done = frame;
            this.end(gen, { done: gen.done });
        }
        else if (frame.type === 'error')
            this.end(gen, { error: streamError(frame, gen.requestId) });
    }
    end(gen, item) {
        this.generations.delete(gen.id);
        gen.push(item);
    }
    failAll(error, keepResumable = false) {
        for (const gen of [...this.generations.values()]) {
            if (!(keepResumable && gen.streamId !== null))
                this.end(gen, { error });
        }
    }
}
async function loadWs() {
    // NOTE: a variable specifier keeps bundlers and tsc from resolving `ws` for browser builds.
    const name = 'ws';
    try {
        const mod = await import(/* @vite-ignore */ name);
        return (mod.WebSocket ?? mod.default);
    }
    catch (err) {
        throw new APIConnectionError('no global WebSocket: on Node 20 install the `ws` package', { cause: err });
    }
}
