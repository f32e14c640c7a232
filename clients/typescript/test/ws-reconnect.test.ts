import { describe, expect, it } from 'vitest';
import { WebSocket, WebSocketServer } from 'ws';
import * as ps from '../src/index.js';

/** A pagedserve.v1-speaking server whose n-th connection closes with closeCodes[n] after its
 * first generate frame (past the list: it answers the generation). */
async function scripted(closeCodes: number[]): Promise<{ url: string; server: WebSocketServer }> {
  const server = new WebSocketServer({ host: '127.0.0.1', port: 0, handleProtocols: () => 'pagedserve.v1' });
  let connections = 0;
  server.on('connection', (socket) => {
    const n = connections++;
    socket.send(JSON.stringify({ type: 'session.created', session_id: `s${n}` }));
    socket.on('message', (raw) => {
      const frame = JSON.parse(String(raw));
      if (frame.type !== 'generate') return;
      if (n < closeCodes.length) return socket.close(closeCodes[n], 'scripted');
      const chunk = { id: 'r', choices: [{ index: 0, delta: { content: 'ok' }, finish_reason: null }] };
      socket.send(JSON.stringify({ type: 'generation.delta', id: frame.id, seq: 0, chunk }));
      socket.send(JSON.stringify({ type: 'generation.done', id: frame.id, status: 'completed', finish_reason: 'stop' }));
    });
  });
  await new Promise((r) => server.once('listening', r));
  const { port } = server.address() as { port: number };
  return { url: `ws://127.0.0.1:${port}/v1/ws`, server };
}

const Ctor = WebSocket as unknown as ps.WebSocketConstructor;

describe('WebSocketClient reconnects', () => {
  it.each([1001, 1011, 1012, 1013])('after close code %i', async (code) => {
    const { url, server } = await scripted([code]);
    const ws = new ps.WebSocketClient(url, { WebSocket: Ctor });
    try {
      const first = await ws.generate({ messages: [] });
      await expect(first.text()).rejects.toBeInstanceOf(ps.APIConnectionError);
      const second = await ws.generate({ messages: [] });
      expect(await second.text()).toBe('ok');
      expect(second.done?.status).toBe('completed');
      expect([ws.reconnects, ws.sessionId]).toEqual([1, 's1']);
    } finally {
      ws.close();
      server.close();
    }
  });

  it('but not after a policy close (1008)', async () => {
    const { url, server } = await scripted([1008]);
    const ws = new ps.WebSocketClient(url, { WebSocket: Ctor });
    try {
      const first = await ws.generate({ messages: [] });
      await expect(first.text()).rejects.toBeInstanceOf(ps.APIConnectionError);
      await expect(ws.generate({ messages: [] })).rejects.toThrow(/1008/);
      expect(ws.reconnects).toBe(0);
    } finally {
      ws.close();
      server.close();
    }
  });
});

describe('WebSocketClient auth', () => {
  it('offers the API key as the bearer.<key> subprotocol (browsers cannot set headers)', async () => {
    let offered: string[] = [];
    const server = new WebSocketServer({
      host: '127.0.0.1', port: 0,
      handleProtocols: (protocols) => { offered = [...protocols]; return 'pagedserve.v1'; },
    });
    await new Promise((r) => server.once('listening', r));
    const { port } = server.address() as { port: number };
    const ws = new ps.PagedServe({ baseURL: `http://127.0.0.1:${port}`, apiKey: 'k1' }).websocket({ WebSocket: Ctor });
    try {
      await ws.connect();
      expect(ws.url).toBe(`ws://127.0.0.1:${port}/v1/ws`);
      expect(offered).toEqual(['pagedserve.v1', 'bearer.k1']);
    } finally {
      ws.close();
      server.close();
    }
  });
});
