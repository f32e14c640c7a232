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

/** A TCP proxy in front of the server whose `cut(ms)` drops every open connection and refuses
 * new ones for `ms` milliseconds: a network outage as the browser sees it. */
export interface CuttableProxy { url: string; cut(ms: number): void; cuts: number; close(): Promise<void> }

export async function cuttableProxy(target: string): Promise<CuttableProxy> {
  const { createServer, connect } = await import('node:net');
  const { hostname, port } = new URL(target);
  const sockets = new Set<import('node:net').Socket>();
  let blockedUntil = 0;
  const server = createServer((client) => {
    if (Date.now() < blockedUntil) { client.destroy(); return; }
    const upstream = connect(Number(port), hostname);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on('close', () => sockets.delete(s));
      s.on('error', () => undefined);
    }
    client.pipe(upstream).pipe(client);
    client.on('close', () => upstream.destroy());
    upstream.on('close', () => client.destroy());
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const proxy: CuttableProxy = {
    url: `http://127.0.0.1:${(server.address() as { port: number }).port}`,
    cuts: 0,
    cut(ms: number) {
      blockedUntil = Date.now() + ms;
      proxy.cuts += 1;
      for (const s of sockets) s.destroy();
    },
    close: () => new Promise<void>((resolve) => {
      for (const s of sockets) s.destroy();
      server.close(() => resolve());
    }),
  };
  return proxy;
}
