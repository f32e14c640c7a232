/** `PagedServe`: the HTTP client (chat completions, completions, responses, embeddings, rerank,
 * score, models, cancel) over fetch.
 * Retries 408/409/429/5xx and network errors with backoff (honouring Retry-After) before any
 * byte of a response reaches the caller; a stream already handed out is never retried, but a
 * resumable one (`resumable: true`) that breaks is resumed after its last event (streaming.ts). */
import { decodeEmbeddings, } from './embeddings.js';
import { APIConnectionError, APITimeoutError, APIUserAbortError, statusError } from './errors.js';
import { retryDelayMs, shouldRetry, sleep } from './retry.js';
import { Stream } from './streaming.js';
import { WebSocketClient } from './ws.js';
export class PagedServe {
    baseURL;
    apiKey;
    timeoutMs;
    maxRetries;
    fetchImpl;
    chat = {
        completions: {
            create: ((params, options) => this.create('/v1/chat/completions', params, options)),
        },
    };
    completions = {
        create: ((params, options) => this.create('/v1/completions', params, options)),
    };
    /** POST /v1/responses (OpenAI's Responses API); GET and DELETE a stored response. */
    responses = {
        create: ((params, options) => this.create('/v1/responses', params, options)),
        /** A stored response; a NotFoundError when it is not stored. */
        retrieve: async (id, options) => (await this.request('GET', `/v1/responses/${encodeURIComponent(id)}`, undefined, options)).response.json(),
        delete: async (id, options) => (await this.request('DELETE', `/v1/responses/${encodeURIComponent(id)}`, undefined, options)).response.json(),
    };
    /** POST /v1/embeddings; a base64 answer (`encoding_format: 'base64'`) comes back decoded. */
    embeddings = {
        create: async (params, options) => decodeEmbeddings(await (await this.request('POST', '/v1/embeddings', params, options)).response.json()),
    };
    /** POST /v1/rerank: the documents by relevance to the query, best first. */
    async rerank(params, options) {
        return (await this.request('POST', '/v1/rerank', params, options)).response.json();
    }
    /** POST /v1/score (vLLM's): a score per (text_1, text_2) pair. */
    async score(params, options) {
        return (await this.request('POST', '/v1/score', params, options)).response.json();
    }
    models = {
        list: async (options) => (await this.request('GET', '/v1/models', undefined, options)).response.json(),
        /** GET /v1/models/{id}; a NotFoundError for another id. */
        retrieve: async (id, options) => (await this.request('GET', `/v1/models/${encodeURIComponent(id)}`, undefined, options)).response.json(),
        /** GET /models (llama.cpp router's): every model the server knows, loaded or not. */
        states: async (options) => (await (await this.request('GET', '/models', undefined, options)).response.json()).data,
        /** POST /models/load: serve `model` again, or a new one from `path` with engine options
         * (max_model_len, data_parallel_size...); resolves once its engines are ready. */
        load: async (model, params = {}, options) => (await this.request('POST', '/models/load', { model, ...params }, options)).response.json(),
        /** POST /models/unload: its requests get `timeout` seconds (default: aborted now), then its
         * engine processes exit. */
        unload: async (model, params = {}, options) => (await this.request('POST', '/models/unload', { model, ...params }, options)).response.json(),
    };
    /** POST /tokenize (vLLM's): `{ prompt }` or `{ messages }` (rendered as chat renders them). */
    async tokenize(body, options) {
        return (await this.request('POST', '/tokenize', body, options)).response.json();
    }
    /** POST /detokenize: the text of token ids. */
    async detokenize(tokens, options) {
        const out = await (await this.request('POST', '/detokenize', { tokens }, options)).response.json();
        return out.prompt;
    }
    constructor(options = {}) {
        const base = options.baseURL ?? globalThis.location?.origin ?? 'http://127.0.0.1:8000';
        this.baseURL = base.replace(/\/+$/, '').replace(/\/v1$/, '');
        this.apiKey = options.apiKey ?? null;
        this.timeoutMs = options.timeoutMs ?? 600_000;
        this.maxRetries = options.maxRetries ?? 2;
        this.fetchImpl = options.fetch ?? ((...args) => globalThis.fetch(...args));
    }
    /** Ask the server to abort a running request (by the X-Request-Id it returned). */
    async cancel(requestId, options) {
        const path = `/v1/requests/${encodeURIComponent(requestId)}/cancel`;
        await (await this.request('POST', path, undefined, options)).response.arrayBuffer();
    }
    /** A WebSocket client for this server (same base URL and key). */
    websocket(options = {}) {
        const url = this.baseURL.replace(/^http/, 'ws') + '/v1/ws';
        return new WebSocketClient(url, { apiKey: this.apiKey, ...options });
    }
    async create(path, params, options) {
        const { response, controller } = await this.request('POST', path, params, options);
        if (params.stream)
            return new Stream(response, controller, this.resumer(response, options));
        return response.json();
    }
    /** How a resumable stream (one whose response named an `X-Stream-Id`) reopens and cancels. */
    resumer(response, options) {
        const streamId = response.headers.get('x-stream-id');
        if (streamId === null)
            return null;
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
    async request(method, path, body, options = {}) {
        const headers = { Accept: 'application/json' };
        if (body !== undefined)
            headers['Content-Type'] = 'application/json';
        if (this.apiKey)
            headers.Authorization = `Bearer ${this.apiKey}`;
        Object.assign(headers, options.headers);
        for (let attempt = 0;; attempt++) {
            const last = attempt >= this.maxRetries;
            const controller = new AbortController();
            const timer = setTimeout(() => controller.abort(new APITimeoutError('request timed out')), this.timeoutMs);
            const onAbort = () => controller.abort(options.signal?.reason);
            options.signal?.addEventListener('abort', onAbort, { once: true });
            let response;
            try {
                if (options.signal?.aborted)
                    throw new APIUserAbortError('request aborted');
                response = await this.fetchImpl(this.baseURL + path, {
                    method, headers, signal: controller.signal,
                    body: body === undefined ? undefined : JSON.stringify(body),
                });
            }
            catch (err) {
                clearTimeout(timer);
                if (options.signal?.aborted || err instanceof APIUserAbortError)
                    throw new APIUserAbortError('request aborted', { cause: err });
                const timedOut = controller.signal.reason instanceof APITimeoutError;
                if (last)
                    throw timedOut ? new APITimeoutError('request timed out', { cause: err }) : new APIConnectionError(`connection error: ${err.message}`, { cause: err });
                await sleep(retryDelayMs(attempt), options.signal);
                continue;
            }
            // NOTE: the timeout covers the wait for headers; a stream may then run as long as it needs.
            clearTimeout(timer);
            if (response.ok)
                return { response, controller };
            const text = await response.text();
            if (last || !shouldRetry(response.status)) {
                throw statusError(response.status, text, response.headers.get('x-request-id'));
            }
            await sleep(retryDelayMs(attempt, response.headers), options.signal);
        }
    }
}
