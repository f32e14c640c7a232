/** Retry policy shared with the Python SDK: which answers to retry and how long to wait. */
export const INITIAL_DELAY_MS = 500;
export const MAX_DELAY_MS = 8000;
export const MAX_RETRY_AFTER_MS = 60_000;
export function shouldRetry(status) {
    return status === 408 || status === 409 || status === 429 || status >= 500;
}
/** Milliseconds before retry number `attempt` (0-based): the server's Retry-After when it gives
 * a sensible one, else exponential backoff with jitter. */
export function retryDelayMs(attempt, headers) {
    const given = headers ? retryAfterMs(headers) : null;
    if (given !== null)
        return given;
    const base = Math.min(INITIAL_DELAY_MS * 2 ** attempt, MAX_DELAY_MS);
    return base * (1 - 0.25 * Math.random());
}
function retryAfterMs(headers) {
    // NOTE: like the official SDKs, a zero or absurd value is ignored in favour of backoff.
    let value = null;
    const ms = headers.get('retry-after-ms');
    const raw = headers.get('retry-after');
    if (ms !== null)
        value = Number(ms);
    else if (raw !== null) {
        value = Number(raw) * 1000;
        if (Number.isNaN(value))
            value = Date.parse(raw) - Date.now();
    }
    if (value === null || !(value > 0 && value <= MAX_RETRY_AFTER_MS))
        return null;
    return value;
}
/** Resolves after `ms`, or rejects with the signal's reason when it aborts first. */
export function sleep(ms, signal) {
    return new Promise((resolve, reject) => {
        if (signal?.aborted)
            return reject(signal.reason);
        const timer = setTimeout(() => { signal?.removeEventListener('abort', onAbort); resolve(); }, ms);
        const onAbort = () => { clearTimeout(timer); reject(signal?.reason); };
        signal?.addEventListener('abort', onAbort, { once: true });
    });
}
