import { execFileSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { expect, it } from 'vitest';

const HERE = fileURLToPath(new URL('..', import.meta.url));
const COMMITTED = fileURLToPath(new URL('../../../gateway/static/sdk/', import.meta.url));

it('the chat page\'s committed SDK build matches src/ (run `npm run build:browser`)', () => {
  const out = mkdtempSync(join(tmpdir(), 'pagedserve-sdk-'));
  try {
    execFileSync(join(HERE, 'node_modules/.bin/tsc'), ['-p', 'tsconfig.browser.json', '--outDir', out], { cwd: HERE });
    const files = readdirSync(out).sort();
    expect(readdirSync(COMMITTED).sort()).toEqual(files);
    for (const f of files) expect(readFileSync(join(COMMITTED, f), 'utf8'), f).toBe(readFileSync(join(out, f), 'utf8'));
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});
