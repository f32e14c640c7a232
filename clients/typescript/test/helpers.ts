/** Shared test helpers: the server's metrics, and a proxy that cuts the network. */

import { createConnection, createServer, type Server, type Socket } from 'node:net';

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


/** A TCP proxy to the server whose `cut(downForMs)` drops every connection through it and
 * refuses new ones for that long: the network going away under a client. */
export class CuttingProxy {
  cuts = 0;
  private live = new Set<Socket>();
  private downUntil = 0;
  private constructor(private readonly server: Server, readonly url: string) {}

  static async start(target: number): Promise<CuttingProxy> {
    let proxy: CuttingProxy | null = null;
    const server = createServer((client) => {
      if (Date.now() < proxy!.downUntil) return void client.destroy();
      const upstream = createConnection(target, '127.0.0.1');
      for (const sock of [client, upstream]) {
        proxy!.live.add(sock);
        sock.on('error', () => undefined);
        sock.on('close', () => { proxy!.live.delete(sock); client.destroy(); upstream.destroy(); });
      }
      client.pipe(upstream);
      upstream.pipe(client);
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const { port } = server.address() as { port: number };
    proxy = new CuttingProxy(server, `http://127.0.0.1:${port}`);
    return proxy;
  }

  cut(downForMs = 0): void {
    this.cuts++;
    this.downUntil = Date.now() + downForMs;
    for (const sock of this.live) sock.destroy();
  }

  close(): Promise<void> {
    this.cut();
    return new Promise((r) => this.server.close(() => r()));
  }
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
