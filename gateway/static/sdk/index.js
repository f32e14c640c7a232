/** pagedserve's TypeScript SDK: `PagedServe` (HTTP + SSE) and `WebSocketClient`. */
export * from './errors.js';
export { PagedServe } from './client.js';
export { SSEDecoder, iterEvents } from './sse.js';
export { Stream, MAX_RESUMES, TERMINAL_EVENTS } from './streaming.js';
export { retryDelayMs, shouldRetry } from './retry.js';
export { Generation, WebSocketClient, RECONNECT_CODES, NO_RESUME_CODES, SUBPROTOCOL } from './ws.js';
export * from './types.js';
export * from './responses.js';
export * from './embeddings.js';
