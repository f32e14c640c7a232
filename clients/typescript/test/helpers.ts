/** Shared test helpers: the server's metrics. */

export async function metric(baseURL: string, name: string): Promise<number> {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  const match = text.match(new RegExp(`^${name} (\\S+)$`, 'm'));
  if (!match) throw new Error(`no metric ${name}`);
  return Number(match[1]);
}

/** Polls until no request is running; returns the last running count. */
export async function waitIdle(baseURL: string, timeoutMs = 5000): Promise<number> {
  const deadline = Date.now() + timeoutMs;
  let running = await metric(baseURL, 'pagedserve_requests_running');
  while (running > 0 && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
    running = await metric(baseURL, 'pagedserve_requests_running');
  }
  return running;
}

/** Polls a gauge until it reads `want` (the engine's stats reach the gateway with its next
 * outputs or heartbeat, so a first chunk can arrive before they move); returns the last value. */
export async function waitMetric(baseURL: string, name: string, want: number, timeoutMs = 30000): Promise<number> {
  const deadline = Date.now() + timeoutMs;
  let value = await metric(baseURL, name);
  while (value !== want && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
    value = await metric(baseURL, name);
  }
  return value;
}
