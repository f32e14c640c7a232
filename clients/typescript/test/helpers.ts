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
