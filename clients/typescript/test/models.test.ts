/** Run-time models through the SDK on a real server of its own (`--enable-model-management`):
 * states, load a second model with engine options, ask it by name, unload it (its engine PID
 * gone), and the typed errors for a model that is not served. */

import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import * as ps from '../src/index.js';

const ROOT = fileURLToPath(new URL('../../../', import.meta.url));
const KEY = 'models-key';
// NOTE: the tiny model tests/clients/tiny_server.py builds (the shared server built it already)
const TINY = join(tmpdir(), 'pagedserve-test-tiny-llama-v2');

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as { port: number };
      srv.close(() => resolve(port));
    });
    srv.on('error', reject);
  });
}

describe('models: states, load and unload at run time', () => {
  let proc: ChildProcess;
  let client: ps.PagedServe;

  beforeAll(async () => {
    const port = await freePort();
    const python = process.env.PAGEDSERVE_PYTHON ?? `${ROOT}.venv/bin/python`;
    proc = spawn(python, [`${ROOT}tests/clients/tiny_server.py`, String(port),
      '--enable-model-management', '--api-key', KEY], {
      cwd: ROOT, stdio: ['ignore', 'ignore', 'inherit'], env: { ...process.env, PYTHONWARNINGS: 'ignore' },
    });
    client = new ps.PagedServe({ baseURL: `http://127.0.0.1:${port}`, apiKey: KEY, maxRetries: 0 });
    const deadline = Date.now() + 120_000;
    for (;;) {
      try {
        if ((await client.models.states()).some((m) => m.status.value === 'loaded')) break;
      } catch { /* NOTE: not listening yet */ }
      if (Date.now() > deadline || proc.exitCode !== null) throw new Error('the server never served its model');
      await new Promise((r) => setTimeout(r, 300));
    }
  });

  afterAll(async () => {
    if (!proc || proc.exitCode !== null) return;
    const exited = new Promise((r) => proc.once('exit', r));
    proc.kill('SIGTERM');
    await exited;
  });

  it('loads a second model, asks it by name and unloads it', { timeout: 180_000 }, async () => {
    const [first] = await client.models.states();
    expect(first.id).toBe('tiny-llama');
    expect(first.pids.length).toBe(1);
    await expect(client.models.load('tiny-2', { path: TINY, max_model_len: 'long' }))
      .rejects.toMatchObject({ name: 'BadRequestError', param: 'max_model_len' });
    const loaded = await client.models.load('tiny-2', { path: TINY, max_model_len: 256 });
    expect(loaded).toMatchObject({ success: true, model: 'tiny-2' });
    const cards = (await client.models.list()).data;
    expect(cards.map((m) => [m.id, m.max_model_len])).toEqual([['tiny-llama', 4096], ['tiny-2', 256]]);
    const reply = await client.chat.completions.create({
      model: 'tiny-2', messages: [{ role: 'user', content: 'hi' }], max_tokens: 3, ignore_eos: true,
    });
    expect(reply.model).toBe('tiny-2');

    const unloaded = await client.models.unload('tiny-2');
    expect(unloaded.pids).toEqual(loaded.pids);
    expect(loaded.pids.every((pid) => !existsSync(`/proc/${pid}`))).toBe(true);
    const states = await client.models.states();
    expect(states.find((m) => m.id === 'tiny-2')?.status.value).toBe('unloaded');
    await expect(client.chat.completions.create({ model: 'tiny-2', messages: [{ role: 'user', content: 'hi' }] }))
      .rejects.toBeInstanceOf(ps.NotFoundError);
    await expect(client.models.unload('tiny-2')).rejects.toBeInstanceOf(ps.NotFoundError);
    await expect(new ps.PagedServe({ baseURL: client.baseURL, maxRetries: 0 }).models.states())
      .rejects.toBeInstanceOf(ps.AuthenticationError);
  });
});
