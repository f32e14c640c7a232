/** Typed errors: one class per HTTP status family, carrying the server's code, param, type. */
/** Base of every error the SDK throws. */
export class PagedServeError extends Error {
    name = 'PagedServeError';
}
/** An error the server reported: an HTTP status, or an error event inside a stream. */
export class APIError extends PagedServeError {
    name = 'APIError';
    status;
    code;
    param;
    type;
    requestId;
    body;
    constructor(message, init = {}) {
        super(message);
        this.status = init.status;
        this.code = init.code ?? null;
        this.param = init.param ?? null;
        this.type = init.type ?? null;
        this.requestId = init.requestId ?? null;
        this.body = init.body;
    }
}
export class APIStatusError extends APIError {
    name = 'APIStatusError';
}
export class BadRequestError extends APIStatusError {
    name = 'BadRequestError';
}
export class AuthenticationError extends APIStatusError {
    name = 'AuthenticationError';
}
export class PermissionDeniedError extends APIStatusError {
    name = 'PermissionDeniedError';
}
export class NotFoundError extends APIStatusError {
    name = 'NotFoundError';
}
export class ConflictError extends APIStatusError {
    name = 'ConflictError';
}
export class RequestTooLargeError extends APIStatusError {
    name = 'RequestTooLargeError';
}
export class UnprocessableEntityError extends APIStatusError {
    name = 'UnprocessableEntityError';
}
export class RateLimitError extends APIStatusError {
    name = 'RateLimitError';
}
export class InternalServerError extends APIStatusError {
    name = 'InternalServerError';
}
export class ServiceUnavailableError extends InternalServerError {
    name = 'ServiceUnavailableError';
}
/** An `{"error": ...}` event arrived inside a stream (SSE or WebSocket). */
export class StreamError extends APIError {
    name = 'StreamError';
}
/** The server could not be reached, or the connection broke. */
export class APIConnectionError extends PagedServeError {
    name = 'APIConnectionError';
    constructor(message = 'connection error', options) {
        super(message, options);
    }
}
export class APITimeoutError extends APIConnectionError {
    name = 'APITimeoutError';
}
/** The caller aborted the request through its AbortSignal. */
export class APIUserAbortError extends PagedServeError {
    name = 'APIUserAbortError';
}
const BY_STATUS = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError,
    404: NotFoundError, 409: ConflictError, 413: RequestTooLargeError,
    422: UnprocessableEntityError, 429: RateLimitError, 503: ServiceUnavailableError,
};
function fields(body) {
    const error = body?.error;
    if (typeof error !== 'object' || error === null)
        return {};
    const e = error;
    const str = (v) => (typeof v === 'string' ? v : null);
    return { message: str(e.message) ?? undefined, code: str(e.code), param: str(e.param), type: str(e.type) };
}
/** The typed error for a response with this status and body text (JSON or not). */
export function statusError(status, text, requestId) {
    let body = text;
    try {
        body = JSON.parse(text);
    }
    catch { /* NOTE: a proxy may answer with plain text */ }
    const { message, ...rest } = fields(body);
    const Cls = BY_STATUS[status] ?? (status >= 500 ? InternalServerError : APIStatusError);
    return new Cls(message ?? (text || `HTTP ${status}`), { ...rest, status, requestId, body });
}
/** The error for an in-stream `{"error": {...}}` payload. */
export function streamError(payload, requestId = null) {
    const { message, ...rest } = fields(payload);
    return new StreamError(message ?? 'the server reported an error mid-stream', { ...rest, requestId, body: payload });
}
