/** `PagedServe`: the HTTP client (chat completions, completions, responses, embeddings, rerank,
 * score, models, cancel) over fetch.
 * Retries 408/409/429/5xx and network errors with backoff (honouring Retry-After) before any
 * byte of a response reaches the caller; a stream already handed out is never retried, but a
 * resumable one (`resumable: true`) that breaks is resumed after its last event (streaming.ts). */

import {
  decodeEmbeddings, type CreateEmbeddingResponse, type EmbeddingCreateParams, type RerankParams,
  type RerankResponse, type ScoreParams, type ScoreResponse,
} from './embeddings.js';
import { APIConnectionError, APITimeoutError, APIUserAbortError, statusError } from './errors.js';
import type { ResponseCreateParams, ResponseObject, ResponseStreamEvent } from './responses.js';
import { retryDelayMs, shouldRetry, sleep } from './retry.js';
import { Stream, type Resumer } from './streaming.js';
import type {
  ChatCompletion, ChatCompletionChunk, ChatCompletionParams, ChatMessageParam, Completion,
  CompletionParams, Model, ModelList, ModelLoaded, ModelLoadParams, ModelState, RequestOptions,
  Tokenized,
} from './types.js';
import { WebSocketClient, type WebSocketOptions } from './ws.js';

export interface ClientOptions {
  /** The server root, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted). */
  baseURL?: string;
  apiKey?: string | null;
  /** Per attempt, in milliseconds (default 10 minutes). */
  timeoutMs?: number;
  maxRetries?: number;
  fetch?: typeof fetch;
}

export class PagedServe {
  readonly baseURL: string;
  readonly apiKey: string | null;
  readonly timeoutMs: number;
  readonly maxRetries: number;
  private readonly fetchImpl: typeof fetch;

  readonly chat = {
    completions: {
      create: ((params: ChatCompletionParams & { stream?: boolean }, options?: RequestOptions) =>
        this.create('/v1/chat/completions', params, options)) as {
        (params: ChatCompletionParams & { stream: true }, options?: RequestOptions): Promise<Stream<ChatCompletionChunk>>;
        (params: ChatCompletionParams & { stream?: false }, options?: RequestOptions): Promise<ChatCompletion>;
      },
    },
  };

  readonly completions = {
    create: ((params: CompletionParams & { stream?: boolean }, options?: RequestOptions) =>
      this.create('/v1/completions', params, options)) as {
      (params: CompletionParams & { stream: true }, options?: RequestOptions): Promise<Stream<Completion>>;
      (params: CompletionParams & { stream?: false }, options?: RequestOptions): Promise<Completion>;
    },
  };

  /** POST /v1/responses (OpenAI's Responses API); GET and DELETE a stored response. */
  readonly responses = {
    create: ((params: ResponseCreateParams & { stream?: boolean }, options?: RequestOptions) =>
      this.create('/v1/responses', params, options)) as {
      (params: ResponseCreateParams & { stream: true }, options?: RequestOptions): Promise<Stream<ResponseStreamEvent>>;
      (params: ResponseCreateParams & { stream?: false }, options?: RequestOptions): Promise<ResponseObject>;
    },
    /** A stored response; a NotFoundError when it is not stored. */
    retrieve: async (id: string, options?: RequestOptions): Promise<ResponseObject> =>
      (await this.request('GET', `/v1/responses/${encodeURIComponent(id)}`, undefined, options)).response.json() as Promise<ResponseObject>,
    delete: async (id: string, options?: RequestOptions): Promise<{ id: string; deleted: boolean }> =>
      (await this.request('DELETE', `/v1/responses/${encodeURIComponent(id)}`, undefined, options)).response.json() as Promise<{ id: string; deleted: boolean }>,
  };

  /** POST /v1/embeddings; a base64 answer (`encoding_format: 'base64'`) comes back decoded. */
  readonly embeddings = {
    create: async (params: EmbeddingCreateParams, options?: RequestOptions): Promise<CreateEmbeddingResponse> =>
      decodeEmbeddings(await (await this.request('POST', '/v1/embeddings', params, options)).response.json()),
  };

  /** POST /v1/rerank: the documents by relevance to the query, best first. */
  async rerank(params: RerankParams, options?: RequestOptions): Promise<RerankResponse> {
    return (await this.request('POST', '/v1/rerank', params, options)).response.json() as Promise<RerankResponse>;
  }

  /** POST /v1/score (vLLM's): a score per (text_1, text_2) pair. */
  async score(params: ScoreParams, options?: RequestOptions): Promise<ScoreResponse> {
    return (await this.request('POST', '/v1/score', params, options)).response.json() as Promise<ScoreResponse>;
  }

  readonly models = {
    list: async (options?: RequestOptions): Promise<ModelList> =>
      (await this.request('GET', '/v1/models', undefined, options)).response.json() as Promise<ModelList>,
    /** GET /v1/models/{id}; a NotFoundError for another id. */
    retrieve: async (id: string, options?: RequestOptions): Promise<Model> =>
      (await this.request('GET', `/v1/models/${encodeURIComponent(id)}`, undefined, options)).response.json() as Promise<Model>,
    /** GET /models (llama.cpp router's): every model the server knows, loaded or not. */
    states: async (options?: RequestOptions): Promise<ModelState[]> =>
      ((await (await this.request('GET', '/models', undefined, options)).response.json()) as { data: ModelState[] }).data,
    /** POST /models/load: serve `model` again, or a new one from `path` with engine options
     * (max_model_len, data_parallel_size...); resolves once its engines are ready. */
    load: async (model: string, params: ModelLoadParams = {}, options?: RequestOptions): Promise<ModelLoaded> =>
      (await this.request('POST', '/models/load', { model, ...params }, options)).response.json() as Promise<ModelLoaded>,
    /** POST /models/unload: its requests get `timeout` seconds (default: aborted now), then its
     * engine processes exit. */
    unload: async (model: string, params: { timeout?: number } = {}, options?: RequestOptions): Promise<ModelLoaded> =>
      (await this.request('POST', '/models/unload', { model, ...params }, options)).response.json() as Promise<ModelLoaded>,
  };

  /** POST /tokenize (vLLM's): `{ prompt }` or `{ messages }` (rendered as chat renders them). */
  async tokenize(body: { prompt: string } | { messages: ChatMessageParam[]; [extra: string]: unknown }, options?: RequestOptions): Promise<Tokenized> {
    return (await this.request('POST', '/tokenize', body, options)).response.json() as Promise<Tokenized>;
  }

  /** POST /detokenize: the text of token ids. */
  async detokenize(tokens: number[], options?: RequestOptions): Promise<string> {
    const out = await (await this.request('POST', '/detokenize', { tokens }, options)).response.json() as { prompt: string };
    return out.prompt;
  }

  constructor(options: ClientOptions = {}) {
    const base = options.baseURL ?? globalThis.location?.origin ?? 'http://127.0.0.1:8000';
    this.baseURL = base.replace(/\/+$/, '').replace(/\/v1$/, '');
    this.apiKey = options.apiKey ?? null;
    this.timeoutMs = options.timeoutMs ?? 600_000;
    this.maxRetries = options.maxRetries ?? 2;
    this.fetchImpl = options.fetch ?? ((...args) => globalThis.fetch(...args));
  }

  /** Ask the server to abort a running request (by the X-Request-Id it returned). */
  async cancel(requestId: string, options?: RequestOptions): Promise<void> {
    const path = `/v1/requests/${encodeURIComponent(requestId)}/cancel`;
    await (await this.request('POST', path, undefined, options)).response.arrayBuffer();
  }

  /** A WebSocket client for this server (same base URL and key). */
  websocket(options: Omit<WebSocketOptions, 'apiKey'> = {}): WebSocketClient {
    const url = this.baseURL.replace(/^http/, 'ws') + '/v1/ws';
    return new WebSocketClient(url, { apiKey: this.apiKey, ...options });
  }

  private async create(path: string, params: { stream?: boolean }, options?: RequestOptions): Promise<any> {
    const { response, controller } = await this.request('POST', path, params, options);
    if (params.stream) return new Stream(response, controller, this.resumer(response, options));
    return response.json();
  }

  /** How a resumable stream (one whose response named an `X-Stream-Id`) reopens and cancels. */
  private resumer(response: Response, options?: RequestOptions): Resumer | null {
    const streamId = response.headers.get('x-stream-id');
    if (streamId === null) return null;
    const path = `/v1/streams/${encodeURIComponent(streamId)}`;
    return {
      streamId,
      reopen: (lastEventId) => this.request('GET', path, undefined, {
        ...options, headers: lastEventId ? { 'Last-Event-ID': lastEventId } : undefined,
      }),
      cancel: async () => { await (await this.request('DELETE', path, undefined)).response.arrayBuffer(); },
    };
  }

  /** Send with retries; resolves to a 2xx response or rejects with a typed error. */
  async request(method: string, path: string, body: unknown, options: RequestOptions = {}):
    Promise<{ response: Response; controller: AbortController }> {
    const headers: Record<string, string> = { Accept: 'application/json' };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    Object.assign(headers, options.headers);
    for (let attempt = 0; ; attempt++) {
      const last = attempt >= this.maxRetries;
      const controller = new AbortController();
      const timer = setTimeout(() => controller.abort(new APITimeoutError('request timed out')), this.timeoutMs);
      const onAbort = () => controller.abort(options.signal?.reason);
      options.signal?.addEventListener('abort', onAbort, { once: true });
      let response: Response;
      try {
        if (options.signal?.aborted) throw new APIUserAbortError('request aborted');
        response = await this.fetchImpl(this.baseURL + path, {
          method, headers, signal: controller.signal,
          body: body === undefined ? undefined : JSON.stringify(body),
        });
      } catch (err) {
        clearTimeout(timer);
        if (options.signal?.aborted || err instanceof APIUserAbortError) throw new APIUserAbortError('request aborted', { cause: err });
        const timedOut = controller.signal.reason instanceof APITimeoutError;
        if (last) throw timedOut ? new APITimeoutError('request timed out', { cause: err }) : new APIConnectionError(`connection error: ${(err as Error).message}`, { cause: err });
        await sleep(retryDelayMs(attempt), options.signal);
        continue;
      }
      // NOTE: the timeout covers the wait for headers; a stream may then run as long as it needs.
      clearTimeout(timer);
      if (response.ok) return { response, controller };
      const text = await response.text();
      if (last || !shouldRetry(response.status)) {
        throw statusError(response.status, text, response.headers.get('x-request-id'));
      }
      await sleep(retryDelayMs(attempt, response.headers), options.signal);
    }
  }
}
