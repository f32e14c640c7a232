/** Typed errors: one class per HTTP status family, carrying the server's code, param, type. */

export interface ErrorInit {
  status?: number;
  code?: string | null;
  param?: string | null;
  type?: string | null;
  requestId?: string | null;
  body?: unknown;
}

/** Base of every error the SDK throws. */
export class PagedServeError extends Error {
  override name = 'PagedServeError';
}

/** An error the server reported: an HTTP status, or an error event inside a stream. */
export class APIError extends PagedServeError {
  override name = 'APIError';
  readonly status: number | undefined;
  readonly code: string | null;
  readonly param: string | null;
  readonly type: string | null;
  readonly requestId: string | null;
  readonly body: unknown;

  constructor(message: string, init: ErrorInit = {}) {
    super(message);
    this.status = init.status;
    this.code = init.code ?? null;
    this.param = init.param ?? null;
    this.type = init.type ?? null;
    this.requestId = init.requestId ?? null;
    this.body = init.body;
  }
}

export class APIStatusError extends APIError { override name = 'APIStatusError'; }
export class BadRequestError extends APIStatusError { override name = 'BadRequestError'; }
export class AuthenticationError extends APIStatusError { override name = 'AuthenticationError'; }
export class PermissionDeniedError extends APIStatusError { override name = 'PermissionDeniedError'; }
export class NotFoundError extends APIStatusError { override name = 'NotFoundError'; }
export class ConflictError extends APIStatusError { override name = 'ConflictError'; }
export class RequestTooLargeError extends APIStatusError { override name = 'RequestTooLargeError'; }
export class UnprocessableEntityError extends APIStatusError { override name = 'UnprocessableEntityError'; }
export class RateLimitError extends APIStatusError { override name = 'RateLimitError'; }
export class InternalServerError extends APIStatusError { override name = 'InternalServerError'; }
export class ServiceUnavailableError extends InternalServerError { override name = 'ServiceUnavailableError'; }

/** An `{"error": ...}` event arrived inside a stream (SSE or WebSocket). */
export class StreamError extends APIError { override name = 'StreamError'; }

/** The server could not be reached, or the connection broke. */
export class APIConnectionError extends PagedServeError {
  override name = 'APIConnectionError';
  constructor(message = 'connection error', options?: { cause?: unknown }) {
    super(message, options);
  }
}
export class APITimeoutError extends APIConnectionError { override name = 'APITimeoutError'; }

/** The caller aborted the request through its AbortSignal. */
export class APIUserAbortError extends PagedServeError { override name = 'APIUserAbortError'; }

const BY_STATUS: Record<number, typeof APIStatusError> = {
  400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError,
  404: NotFoundError, 409: ConflictError, 413: RequestTooLargeError,
  422: UnprocessableEntityError, 429: RateLimitError, 503: ServiceUnavailableError,
};

function fields(body: unknown): Omit<ErrorInit, 'status' | 'requestId' | 'body'> & { message?: string } {
  const error = (body as { error?: unknown } | null)?.error;
  if (typeof error !== 'object' || error === null) return {};
  const e = error as Record<string, unknown>;
  const str = (v: unknown) => (typeof v === 'string' ? v : null);
  return { message: str(e.message) ?? undefined, code: str(e.code), param: str(e.param), type: str(e.type) };
}

/** The typed error for a response with this status and body text (JSON or not). */
export function statusError(status: number, text: string, requestId: string | null): APIStatusError {
  let body: unknown = text;
  try { body = JSON.parse(text); } catch { /* NOTE: a proxy may answer with plain text */ }
  const { message, ...rest } = fields(body);
  const Cls = BY_STATUS[status] ?? (status >= 500 ? InternalServerError : APIStatusError);
  return new Cls(message ?? (text || `HTTP ${status}`), { ...rest, status, requestId, body });
}

/** The error for an in-stream `{"error": {...}}` payload. */
export function streamError(payload: unknown, requestId: string | null = null): StreamError {
  const { message, ...rest } = fields(payload);
  return new StreamError(message ?? 'the server reported an error mid-stream', { ...rest, requestId, body: payload });
}
