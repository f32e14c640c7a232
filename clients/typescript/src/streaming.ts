/** SSE responses as AsyncIterables of chunks; `break` or the AbortSignal drops the connection,
 * which the server turns into an abort of the request. */

import { APIConnectionError, APIUserAbortError, streamError } from './errors.js';
import { iterEvents } from './sse.js';

export class Stream<T> implements AsyncIterable<T> {
  readonly requestId: string | null;
  private consumed = false;

  constructor(readonly response: Response, private readonly controller: AbortController) {
    this.requestId = response.headers.get('x-request-id');
  }

  /** Stop reading and cancel the request on the server. */
  abort(): void {
    this.controller.abort();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<T> {
    if (this.consumed) throw new Error('a Stream can be iterated only once');
    this.consumed = true;
    if (!this.response.body) throw new APIConnectionError('the response has no body');
    let finished = false;
    try {
      for await (const event of iterEvents(this.response.body)) {
        if (event.data === '[DONE]') {
          finished = true;
          return;
        }
        yield this.decode(event.data, event.event);
      }
      finished = true; // NOTE: a Responses stream ends with its body, not with [DONE]
    } catch (err) {
      if (this.controller.signal.aborted) throw new APIUserAbortError('request aborted', { cause: err });
      if (err instanceof TypeError || (err as Error)?.name === 'AbortError') {
        throw new APIConnectionError(`stream broke: ${(err as Error).message}`, { cause: err });
      }
      throw err;
    } finally {
      // NOTE: on `break` or an error this drops the connection, which cancels on the server.
      if (!finished) this.controller.abort();
    }
  }

  private decode(data: string, event: string | null): T {
    let payload: unknown;
    try {
      payload = JSON.parse(data);
    } catch (err) {
      throw new APIConnectionError(`invalid JSON in stream: ${data.slice(0, 80)}`, { cause: err });
    }
    if (event === 'error' || (typeof payload === 'object' && payload !== null && 'error' in payload)) {
      throw streamError(payload, this.requestId);
    }
    return payload as T;
  }
}
