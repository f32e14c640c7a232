/** pagedserve's TypeScript SDK: `PagedServe` (HTTP + SSE) and `WebSocketClient`. */

export * from './errors.js';
export { PagedServe, type ClientOptions } from './client.js';
export { SSEDecoder, iterEvents, type ServerSentEvent } from './sse.js';
export { Stream, MAX_RESUMES, TERMINAL_EVENTS, type Resumer } from './streaming.js';
export { retryDelayMs, shouldRetry } from './retry.js';
export { Generation, WebSocketClient, RECONNECT_CODES, NO_RESUME_CODES, SUBPROTOCOL, type WebSocketOptions, type WebSocketLike, type WebSocketConstructor } from './ws.js';
export * from './types.js';
export * from './responses.js';
export * from './embeddings.js';
