import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium, type BrowserContext, type Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { metric, waitIdle } from './helpers.js';

const baseURL = inject('baseURL');
const ARTIFACTS = fileURLToPath(new URL('../../../test-artifacts/', import.meta.url));
// NOTE: the flags that work for Debian's chromium on these machines (no GPU, no sandbox, offline).
const FLAGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];

describe('chat page in headless Chromium', () => {
  let profile: string;
  let context: BrowserContext;
  let page: Page;

  beforeAll(async () => {
    profile = mkdtempSync(join(tmpdir(), 'pagedserve-chromium-'));
    context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium', headless: true, args: FLAGS,
      viewport: { width: 1000, height: 700 },
    });
    page = context.pages()[0] ?? await context.newPage();
    await page.goto(`${baseURL}/`);
    await page.waitForSelector('#model option[value="tiny-llama"]', { state: 'attached' });
    await page.waitForFunction(() => document.getElementById('connection')?.textContent === 'connected');
  });

  afterAll(async () => {
    await context?.close();
    rmSync(profile, { recursive: true, force: true });
  });

  it('streams a reply, and Stop ends it and frees the server', async () => {
    await page.fill('#max-tokens', '3000');
    await page.fill('#prompt', 'Tell me a long story about a dragon.');
    await page.click('#send');
    const reply = page.locator('.msg.assistant .content').last();
    await expect.poll(async () => (await reply.textContent())?.length ?? 0, { timeout: 20_000 }).toBeGreaterThan(20);
    expect(await page.getAttribute('body', 'data-state')).toBe('generating');
    expect(await metric(baseURL, 'pagedserve_requests_running')).toBe(1);
    await expect.poll(() => page.textContent('#stats')).toMatch(/TTFT \d+ ms · [\d.]+ tokens\/s/);
    mkdirSync(ARTIFACTS, { recursive: true });
    await page.screenshot({ path: join(ARTIFACTS, 'chat-streaming.png') });
    await page.click('#stop');
    await expect.poll(() => page.getAttribute('body', 'data-state')).toBe('idle');
    expect(await page.textContent('#stats')).toMatch(/stopped$/);
    expect(await page.isDisabled('#stop')).toBe(true);
    expect(await waitIdle(baseURL)).toBe(0);
    await page.screenshot({ path: join(ARTIFACTS, 'chat-stopped.png') });
  });

  it('shows a server error in plain words', async () => {
    await page.fill('#max-tokens', '100000');
    await page.fill('#prompt', 'Hello again');
    await page.press('#prompt', 'Enter');
    await expect.poll(() => page.isVisible('#error')).toBe(true);
    expect(await page.textContent('#error')).toMatch(/too long for the model.*maximum context length is 4096/);
    expect(await page.getAttribute('body', 'data-state')).toBe('idle');
    await page.screenshot({ path: join(ARTIFACTS, 'chat-error.png') });
  });
});
