/** Starts one real pagedserve (tiny random Llama) on a free 127.0.0.1 port for all test files. */

import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { fileURLToPath } from 'node:url';
import type { TestProject } from 'vitest/node';

const ROOT = fileURLToPath(new URL('../../../', import.meta.url));

declare module 'vitest' {
  export interface ProvidedContext { baseURL: string }
}

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

async function waitHealthy(url: string, proc: ChildProcess, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (proc.exitCode !== null) throw new Error(`server exited with ${proc.exitCode}`);
    try {
      if ((await fetch(`${url}/health`)).status === 200) return;
    } catch { /* NOTE: not listening yet */ }
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error(`${url}/health never answered 200`);
}

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  const port = await freePort();
  const python = process.env.PAGEDSERVE_PYTHON ?? `${ROOT}.venv/bin/python`;
  const proc = spawn(python, [`${ROOT}tests/clients/tiny_server.py`, String(port)], {
    cwd: ROOT, stdio: ['ignore', 'ignore', 'inherit'],
    env: { ...process.env, PYTHONWARNINGS: 'ignore' },
  });
  const url = `http://127.0.0.1:${port}`;
  const stop = async () => {
    if (proc.exitCode !== null) return;
    const exited = new Promise((r) => proc.once('exit', r));
    proc.kill('SIGTERM');
    const timer = setTimeout(() => proc.kill('SIGKILL'), 20_000);
    await exited;
    clearTimeout(timer);
  };
  try {
    await waitHealthy(url, proc, 120_000);
  } catch (err) {
    await stop();
    throw err;
  }
  project.provide('baseURL', url);
  return stop;
}
