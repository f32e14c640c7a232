/** SSE responses as AsyncIterables of chunks; `break` or the AbortSignal drops the connection,
 * which the server turns into an abort of the request. */
import { APIConnectionError, APIUserAbortError, streamError } from './errors.js';
import { iterEvents } from './sse.js';
export class Stream {
    response;
    controller;
    requestId;
    consumed = false;
    constructor(response, controller) {
        this.response = response;
        this.controller = controller;
        this.requestId = response.headers.get('x-request-id');
    }
    /** Stop reading and cancel the request on the server. */
    abort() {
        this.controller.abort();
    }
    async *[Symbol.asyncIterator]() {
        if (this.consumed)
            throw new Error('a Stream can be iterated only once');
        this.consumed = true;
        if (!this.response.body)
            throw new APIConnectionError('the response has no body');
        let finished = false;
        try {
            for await (const event of iterEvents(this.response.body)) {
                if (event.data === '[DONE]') {
                    finished = true;
                    return;
                }
                yield this.decode(event.data, event.event);
            }
        }
        catch (err) {
            if (this.controller.signal.aborted)
                throw new APIUserAbortError('request aborted', { cause: err });
            if (err instanceof TypeError || err?.name === 'AbortError') {
                throw new APIConnectionError(`stream broke: ${err.message}`, { cause: err });
            }
            throw err;
        }
        finally {
            // NOTE: on `break` or an error this drops the connection, which cancels on the server.
            if (!finished)
                this.controller.abort();
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
