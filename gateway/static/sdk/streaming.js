/** SSE responses as AsyncIterables of chunks; `break` or the AbortSignal drops the connection,
 * which the server turns into an abort of the request.
 *
 * A resumable stream (the response named an `X-Stream-Id`) that breaks is reopened with
 * `GET /v1/streams/{id}` and `Last-Event-ID`: the server sends only the events after the last one
 * read, so the text continues exactly once; leaving it early cancels it with `DELETE`. It has
 * ended at `[DONE]` (chat, completions) or at its terminal event (Responses, Messages, which send
 * no `[DONE]`); a body that ends before either is a break. */
import { APIConnectionError, APIUserAbortError, streamError } from './errors.js';
import { retryDelayMs, sleep } from './retry.js';
import { iterEvents } from './sse.js';
/** Reconnects in a row that bring no new event before a resumable stream gives up. */
export const MAX_RESUMES = 5;
/** The SSE `event:` names that end a stream which sends no [DONE] (Responses, Messages). */
export const TERMINAL_EVENTS = new Set([
    'response.completed', 'response.incomplete', 'response.failed', 'message_stop', 'error',
]);
export class Stream {
    response;
    controller;
    resumer;
    requestId;
    streamId;
    /** The last SSE id read (`<stream id>:<seq>` on a resumable stream). */
    lastEventId = null;
    /** Reconnects made after the connection dropped. */
    resumes = 0;
    consumed = false;
    constructor(response, controller, resumer = null) {
        this.response = response;
        this.controller = controller;
        this.resumer = resumer;
        this.requestId = response.headers.get('x-request-id');
        this.streamId = resumer?.streamId ?? null;
    }
    /** Stop reading and cancel the request on the server. */
    abort() {
        this.controller.abort();
    }
    async *[Symbol.asyncIterator]() {
        if (this.consumed)
            throw new Error('a Stream can be iterated only once');
        this.consumed = true;
        let finished = false;
        let fruitless = 0;
        try {
            for (;;) {
                let broke;
                try {
                    if (!this.response.body)
                        throw new APIConnectionError('the response has no body');
                    for await (const event of iterEvents(this.response.body)) {
                        if (event.id !== null)
                            this.lastEventId = event.id;
                        fruitless = 0;
                        if (event.data === '[DONE]') {
                            finished = true;
                            return;
                        }
                        if (event.event !== null && TERMINAL_EVENTS.has(event.event)) {
                            finished = true; // NOTE: before decode: an `error` event throws there
                            yield this.decode(event.data, event.event);
                            return;
                        }
                        yield this.decode(event.data, event.event);
                    }
                    if (!this.resumer) {
                        finished = true; // NOTE: a plain stream ends quietly with its body, as before
                        return;
                    }
                    broke = new APIConnectionError('stream ended before its last event');
                }
                catch (err) {
                    if (this.controller.signal.aborted)
                        throw new APIUserAbortError('request aborted', { cause: err });
                    if (!(err instanceof TypeError || err?.name === 'AbortError'))
                        throw err;
                    broke = new APIConnectionError(`stream broke: ${err.message}`, { cause: err });
                    if (!this.resumer)
                        throw broke;
                }
                fruitless = await this.reopen(broke, fruitless);
                this.resumes++;
            }
        }
        finally {
            // NOTE: on `break` or an error this drops the connection, which cancels on the server
            // (a resumable stream outlives its connection, so it is cancelled by DELETE).
            if (!finished) {
                this.controller.abort();
                void this.resumer?.cancel().catch(() => undefined);
            }
        }
    }
    /** Reopen after the last event read, with backoff; returns the reconnects without progress. */
    async reopen(broke, fruitless) {
        for (;;) {
            if (fruitless >= MAX_RESUMES)
                throw broke;
            await sleep(retryDelayMs(fruitless++));
            try {
                const opened = await this.resumer.reopen(this.lastEventId);
                this.response = opened.response;
                this.controller = opened.controller;
                return fruitless;
            }
            catch (err) {
                if (!(err instanceof APIConnectionError))
                    throw err; // e.g. 410 stream_expired
                broke = err;
            }
        }
    }
    decode(data, event) {
        let payload;
        try {
            payload = JSON.parse(data);
        }
        catch (err) {
            throw new APIConnectionError(`invalid JSON in stream: ${data.slice(0, 80)}`, { cause: err });
        }
        if (event === 'error' || (typeof payload === 'object' && payload !== null && 'error' in payload)) {
            throw streamError(payload, this.requestId);
        }
        return payload;
    }
}
