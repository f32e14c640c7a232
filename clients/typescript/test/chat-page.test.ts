import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium, type BrowserContext, type Page, type Route } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { CuttingProxy, metric, waitIdle } from './helpers.js';

const baseURL = inject('baseURL');
const ARTIFACTS = fileURLToPath(new URL('../../../test-artifacts/', import.meta.url));
const FLAGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];
const STORE = 'pagedserve.conversations.v1';

// A reply that tries every way in: raw HTML, event handlers, script, javascript: and data:
// links (Markdown and HTML), HTML inside emphasis, a fence that closes a <script>.
const HOSTILE = [
  'Hello <img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script>',
  '[click me](javascript:window.__pwned=3) and [data](data:text/html,<script>alert(1)</script>)',
  '<a href="javascript:window.__pwned=4">raw link</a> **<svg onload="window.__pwned=5">**',
  '```html', '</code></pre><script>window.__pwned=6</script>', '```',
  '<iframe src="javascript:window.__pwned=7"></iframe> [safe](https://example.com/x "t")',
  '| a | b |', '|---|---|', '| <b onmouseover=alert(1)>x</b> | `y` |',
].join('\n');

/** An SSE body of chat chunks, as the server would send it, ending with [DONE]. */
function sse(deltas: Record<string, unknown>[], finish = 'stop'): string {
  const chunk = (delta: Record<string, unknown>, finish_reason: string | null) => `data: ${JSON.stringify({
    id: 'chatcmpl-scripted', object: 'chat.completion.chunk', created: 0, model: 'tiny-llama',
    choices: [{ index: 0, delta, finish_reason }],
  })}\n\n`;
  return [chunk({ role: 'assistant', content: '' }, null), ...deltas.map((d) => chunk(d, null)),
    chunk({}, finish), 'data: [DONE]\n\n'].join('');
}

function scripted(body: string) {
  return (route: Route) => route.fulfill({
    status: 200, body, headers: { 'content-type': 'text/event-stream', 'x-request-id': 'chatcmpl-scripted' },
  });
}

/** Send `text`, then wait for its answer to end (a scripted one may end before a poll sees it run). */
async function ask(page: Page, text: string): Promise<void> {
  const before = await page.locator('.msg').count();
  await page.fill('#prompt', text);
  await page.press('#prompt', 'Enter');
  await expect.poll(async () => await page.locator('.msg').count() >= before + 2
    && await page.getAttribute('body', 'data-state') === 'idle', { timeout: 60_000 }).toBe(true);
}

describe('chat page: conversations, Markdown, reasoning, tools, regenerate, edit', () => {
  let profile: string;
  let context: BrowserContext;
  let page: Page;

  beforeAll(async () => {
    mkdirSync(ARTIFACTS, { recursive: true });
    profile = mkdtempSync(join(tmpdir(), 'pagedserve-chromium-'));
    context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium', headless: true, args: FLAGS,
      viewport: { width: 1100, height: 760 },
    });
    page = context.pages()[0] ?? await context.newPage();
    page.on('pageerror', (err) => { throw err; });
    await page.goto(`${baseURL}/`);
    await page.waitForFunction(() => document.getElementById('connection')?.textContent === 'connected');
    await page.fill('#max-tokens', '12');
    await page.fill('#seed', '7');
  });

  afterAll(async () => {
    await context?.close();
    rmSync(profile, { recursive: true, force: true });
  });

  it('keeps conversations across a reload, switches and deletes them', async () => {
    await ask(page, 'First conversation');
    const firstReply = await page.locator('.msg.assistant .content').last().textContent();
    expect(firstReply?.length).toBeGreaterThan(0);
    await page.click('#new-chat');
    await ask(page, 'Second conversation');
    await page.reload();
    await page.waitForFunction(() => document.getElementById('connection')?.textContent === 'connected');
    const titles = () => page.locator('#conversations .open').allTextContents();
    expect(await titles()).toEqual(['Second conversation', 'First conversation']);
    expect(await page.textContent('.msg.user .content')).toBe('Second conversation');
    await page.click('#conversations li:has-text("First conversation") .open');
    expect(await page.textContent('.msg.user .content')).toBe('First conversation');
    expect(await page.locator('.msg.assistant .content').last().textContent()).toBe(firstReply);
    await page.hover('#conversations li:has-text("Second conversation")'); // the button shows on hover
    await page.click('#conversations li:has-text("Second conversation") .delete');
    expect(await titles()).toEqual(['First conversation']);
    await page.reload();
    expect(await titles()).toEqual(['First conversation']);
    expect(await waitIdle(baseURL)).toBe(0);
  });

  it('renders a hostile Markdown reply inert, streamed or from storage', async () => {
    await page.route('**/v1/chat/completions', scripted(sse([{ content: HOSTILE.slice(0, 50) }, { content: HOSTILE.slice(50) }])));
    try {
      await page.click('#new-chat');
      await ask(page, 'Say something nasty');
    } finally {
      await page.unroute('**/v1/chat/completions');
    }
    const check = async () => {
      const reply = page.locator('.msg.assistant').last();
      expect(await page.evaluate(() => (window as { __pwned?: unknown }).__pwned)).toBeUndefined();
      expect(await page.locator('#transcript :is(img, script, svg, iframe, b, object, embed)').count()).toBe(0);
      const hrefs = await page.locator('#transcript a').evaluateAll((as) => as.map((a) => [a.getAttribute('href'), a.getAttribute('rel'), a.getAttribute('target')]));
      expect(hrefs).toEqual([['https://example.com/x', 'noopener noreferrer nofollow', '_blank']]);
      const text = await reply.locator('.content').textContent();
      expect(text).toContain('<img src=x onerror="window.__pwned=1">');
      expect(text).toContain('<script>window.__pwned=2</script>');
      expect(text).toContain('click me'); // the unsafe link keeps its words, not its target
      expect(await reply.locator('.content pre code.language-html').textContent()).toBe('</code></pre><script>window.__pwned=6</script>');
      expect(await reply.locator('.content table td').first().textContent()).toBe('<b onmouseover=alert(1)>x</b>');
      expect(await reply.locator('.content strong').textContent()).toBe('<svg onload="window.__pwned=5">');
      await reply.locator('.content').hover();
    };
    await check();
    // the same reply written into localStorage renders by the same path after a reload
    await page.reload();
    await page.waitForFunction(() => document.getElementById('connection')?.textContent === 'connected');
    const stored = await page.evaluate((key) => localStorage.getItem(key) ?? '', STORE);
    expect(stored).toContain('window.__pwned=6');
    await check();
  });

  it('shows reasoning folded and tool calls as calls', async () => {
    const body = sse([
      { reasoning_content: 'The user wants the weather; ' }, { reasoning_content: 'call the tool.' },
      { content: 'Let me check.' },
      { tool_calls: [{ index: 0, id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '' } }] },
      { tool_calls: [{ index: 0, function: { arguments: '{"city": "Par' } }] },
      { tool_calls: [{ index: 0, function: { arguments: 'is", "unit": "C"}' } }] },
    ], 'tool_calls');
    await page.route('**/v1/chat/completions', scripted(body));
    try {
      await page.click('#new-chat');
      await ask(page, 'Weather in Paris?');
    } finally {
      await page.unroute('**/v1/chat/completions');
    }
    const reply = page.locator('.msg.assistant').last();
    const details = reply.locator('details.reasoning');
    expect(await details.evaluate((d) => (d as HTMLDetailsElement).open)).toBe(false);
    expect(await details.locator('summary').textContent()).toBe('Reasoning');
    expect(await details.locator('.reasoning-body').isVisible()).toBe(false);
    expect(await details.locator('.reasoning-body').textContent()).toBe('The user wants the weather; call the tool.');
    await details.locator('summary').click();
    expect(await details.locator('.reasoning-body').isVisible()).toBe(true);
    expect(await reply.locator('.content').textContent()).toBe('Let me check.');
    expect(await reply.locator('.tool-call .tool-name').textContent()).toBe('get_weather');
    expect(JSON.parse(await reply.locator('.tool-call .tool-args').textContent() ?? '')).toEqual({ city: 'Paris', unit: 'C' });
    await page.screenshot({ path: join(ARTIFACTS, 'chat-reasoning-tools.png') });
  });

  it('regenerates the last answer and edits the last message', async () => {
    await page.click('#new-chat');
    await ask(page, 'Tell me about cats');
    const prompts = await metric(baseURL, 'pagedserve_prompt_tokens_total');
    await page.fill('#seed', '8'); // another seed: another answer from the same prompt
    await page.click('.msg.assistant .regenerate');
    await expect.poll(() => page.getAttribute('body', 'data-state'), { timeout: 60_000 }).toBe('idle');
    expect(await page.locator('.msg').count()).toBe(2);
    expect(await metric(baseURL, 'pagedserve_prompt_tokens_total')).toBeGreaterThan(prompts);
    await page.click('.msg.user .edit');
    await page.fill('.msg.user .edit-box', 'Tell me about dogs');
    await page.click('.msg.user .save-edit');
    await expect.poll(() => page.getAttribute('body', 'data-state'), { timeout: 60_000 }).toBe('idle');
    expect(await page.locator('.msg').count()).toBe(2);
    expect(await page.textContent('.msg.user .content')).toBe('Tell me about dogs');
    expect((await page.textContent('.msg.assistant .content'))?.length).toBeGreaterThan(0);
    const stored = await page.evaluate((key) => JSON.parse(localStorage.getItem(key) ?? '[]'), STORE);
    const conv = stored.find((c: { messages: { content: string }[] }) => c.messages[0]?.content === 'Tell me about dogs');
    expect(conv.messages.map((m: { role: string }) => m.role)).toEqual(['user', 'assistant']);
    expect(await waitIdle(baseURL)).toBe(0);
  });

  it('looks right with a Markdown reply, on a desktop and on a phone', async () => {
    const answer = [
      '## Reversing a list', 'In Python you can use **slicing** or `reversed()`:', '',
      '```python', 'items = [1, 2, 3]', 'print(items[::-1])  # [3, 2, 1]', '```', '',
      '1. Slicing makes a *new* list', '2. `list.reverse()` works in place', '',
      '> Tip: see [the docs](https://docs.python.org/3/tutorial/datastructures.html).',
    ].join('\n');
    await page.route('**/v1/chat/completions', scripted(sse([{ content: answer }])));
    try {
      await page.click('#new-chat');
      await ask(page, 'How do I reverse a list in Python?');
    } finally {
      await page.unroute('**/v1/chat/completions');
    }
    const reply = page.locator('.msg.assistant .content').last();
    expect(await reply.locator('h4').textContent()).toBe('Reversing a list');
    expect(await reply.locator('pre code.language-python').textContent()).toBe('items = [1, 2, 3]\nprint(items[::-1])  # [3, 2, 1]');
    expect(await reply.locator('ol > li').count()).toBe(2);
    await page.screenshot({ path: join(ARTIFACTS, 'chat-markdown.png') });
    await page.setViewportSize({ width: 390, height: 780 });
    await expect.poll(() => page.locator('#sidebar').evaluate((s) => s.getBoundingClientRect().right)).toBeLessThanOrEqual(0);
    await page.screenshot({ path: join(ARTIFACTS, 'chat-phone.png') });
    await page.click('#menu');
    await expect.poll(() => page.locator('#sidebar').evaluate((s) => s.getBoundingClientRect().left)).toBe(0);
    await page.screenshot({ path: join(ARTIFACTS, 'chat-phone-conversations.png') });
    await page.click('#scrim', { position: { x: 370, y: 400 } });
    await page.setViewportSize({ width: 1100, height: 760 });
  });

  it('lists every model and adapter in the picker and asks the one picked', async () => {
    const cards = [
      { id: 'tiny-llama', object: 'model', created: 0, owned_by: 'pagedserve' },
      { id: 'other-model', object: 'model', created: 0, owned_by: 'pagedserve' },
      { id: 'tiny-llama-sql', object: 'model', created: 0, owned_by: 'pagedserve', parent: 'tiny-llama' },
    ];
    const asked: string[] = [];
    await page.route('**/v1/models', (route) => route.fulfill({
      status: 200, body: JSON.stringify({ object: 'list', data: cards }), headers: { 'content-type': 'application/json' },
    }));
    await page.route('**/v1/chat/completions', (route) => {
      asked.push(route.request().postDataJSON().model);
      return scripted(sse([{ content: 'From the adapter' }]))(route);
    });
    try {
      await page.evaluate(() => dispatchEvent(new Event('online')));  // NOTE: the page reloads its list
      await expect.poll(() => page.locator('#model option').count()).toBe(3);
      expect(await page.locator('#model option').allTextContents())
        .toEqual(['tiny-llama', 'other-model', 'tiny-llama-sql (adapter of tiny-llama)']);
      await page.selectOption('#model', 'tiny-llama-sql');
      await page.click('#new-chat');
      await ask(page, 'Which model is this?');
      expect(asked).toEqual(['tiny-llama-sql']);
      await page.evaluate(() => dispatchEvent(new Event('online')));  // a reload keeps the pick
      await expect.poll(() => page.locator('#model').inputValue()).toBe('tiny-llama-sql');
    } finally {
      await page.unroute('**/v1/models');
      await page.unroute('**/v1/chat/completions');
    }
    await page.evaluate(() => dispatchEvent(new Event('online')));
    await expect.poll(() => page.locator('#model option').allTextContents()).toEqual(['tiny-llama']);
  });
});

const LONG = 'Write a long story about a lighthouse keeper.';

/** The same request without the page, not streamed: the text the page must end with. */
async function reference(seed: number, maxTokens: number): Promise<{ text: string; promptTokens: number }> {
  const response = await fetch(`${baseURL}/v1/chat/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ messages: [{ role: 'user', content: LONG }], max_tokens: maxTokens, temperature: 0.7, seed }),
  });
  const body = await response.json() as { choices: { message: { content: string }; finish_reason: string }[]; usage: { prompt_tokens: number } };
  expect(body.choices[0].finish_reason).toBe('length'); // NOTE: long enough to be cut mid-way
  return { text: body.choices[0].message.content, promptTokens: body.usage.prompt_tokens };
}

/** Counters that a second generation or a second prefill would move. */
async function counters(): Promise<{ admitted: number; finished: number; computed: number }> {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  const sum = (re: RegExp) => [...text.matchAll(re)].reduce((t, m) => t + Number(m[1]), 0);
  return {
    admitted: sum(/^pagedserve_prompt_tokens_total (\S+)$/gm),
    finished: sum(/^pagedserve_requests_total\{[^}]*\} (\S+)$/gm),
    computed: sum(/^vllm:prompt_tokens_total\{[^}]*\} (\S+)$/gm),
  };
}

/** The text of the current conversation's last message, as the page stored it. */
async function storedReply(page: Page): Promise<string> {
  return page.evaluate((key) => {
    const conv = JSON.parse(localStorage.getItem(key) ?? '[]')
      .find((c: { id: string }) => c.id === localStorage.getItem('pagedserve.current'));
    return conv.messages[conv.messages.length - 1].content;
  }, STORE);
}

describe('chat page: resumable answers', () => {
  const MAX = 1000;
  let profile: string;
  let context: BrowserContext;
  let page: Page;
  let proxy: CuttingProxy; // NOTE: the page talks to the server through it, so the test can cut the network

  beforeAll(async () => {
    proxy = await CuttingProxy.start(Number(new URL(baseURL).port));
    profile = mkdtempSync(join(tmpdir(), 'pagedserve-chromium-'));
    context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium', headless: true, args: FLAGS,
      viewport: { width: 1100, height: 760 },
    });
    page = context.pages()[0] ?? await context.newPage();
    page.on('pageerror', (err) => { throw err; });
    page.on('console', (msg) => { if (msg.type() === 'error') console.log('page:', msg.text()); });
    await page.goto(`${proxy.url}/`);
    await page.waitForFunction(() => document.getElementById('connection')?.textContent === 'connected');
  });

  afterAll(async () => {
    await context?.close();
    await proxy?.close();
    rmSync(profile, { recursive: true, force: true });
  });

  async function start(seed: number): Promise<void> {
    if (await page.locator('.msg').count()) await page.click('#new-chat');
    await page.fill('#max-tokens', String(MAX));
    await page.fill('#temperature', '0.7');
    await page.fill('#seed', String(seed));
    await page.fill('#prompt', LONG);
    await page.press('#prompt', 'Enter');
    const reply = page.locator('.msg.assistant .content').last();
    await expect.poll(async () => (await reply.textContent())?.length ?? 0, { timeout: 30_000 }).toBeGreaterThan(30);
    expect(await page.getAttribute('body', 'data-state')).toBe('generating');
  }

  async function finished(): Promise<void> {
    await expect.poll(() => page.getAttribute('body', 'data-state'), { timeout: 90_000 }).toBe('idle');
    expect(await page.isVisible('#error')).toBe(false);
    expect(await page.locator('.msg.assistant .note').count()).toBe(0); // no "cut off" note
  }

  it('continues after the network drops for two seconds: same text, one prefill', { timeout: 120_000 }, async () => {
    const seed = 21;
    const { text, promptTokens } = await reference(seed, MAX);
    const before = await counters();
    await start(seed);
    const cutAt = (await storedReply(page)).length;
    proxy.cut(2000); // every connection dropped, new ones refused for two seconds
    // the page's own stream broke and it retries (the test does not reload it)
    await expect.poll(() => page.getAttribute('body', 'data-resumes'), { timeout: 10_000 }).not.toBeNull();
    expect(await page.textContent('#connection')).toBe('reconnecting…');
    await finished();
    expect(cutAt).toBeLessThan(text.length); // it was cut mid-answer
    expect(await storedReply(page)).toBe(text);
    const after = await counters();
    expect(after.admitted - before.admitted).toBe(promptTokens); // one request admitted
    expect(after.finished - before.finished).toBe(1);
    expect(after.computed - before.computed).toBeLessThanOrEqual(promptTokens); // one prefill
    expect(await page.textContent('#connection')).toBe('connected');
    expect(await waitIdle(baseURL)).toBe(0);
  });

  it('continues after a reload mid-answer', { timeout: 120_000 }, async () => {
    const seed = 22;
    const { text, promptTokens } = await reference(seed, MAX);
    const before = await counters();
    await start(seed);
    const cutAt = (await storedReply(page)).length;
    await page.reload();
    await expect.poll(() => page.getAttribute('body', 'data-state'), { timeout: 10_000 }).toBe('generating');
    await page.screenshot({ path: join(ARTIFACTS, 'chat-resumed-after-reload.png') });
    await finished();
    expect(cutAt).toBeLessThan(text.length);
    expect(await storedReply(page)).toBe(text);
    const after = await counters();
    expect(after.admitted - before.admitted).toBe(promptTokens);
    expect(after.finished - before.finished).toBe(1);
    expect(after.computed - before.computed).toBeLessThanOrEqual(promptTokens);
    expect(await waitIdle(baseURL)).toBe(0);
  });
});

describe('/dashboard under load', () => {
  let profile: string;
  let context: BrowserContext;
  let page: Page;

  beforeAll(async () => {
    mkdirSync(ARTIFACTS, { recursive: true });
    profile = mkdtempSync(join(tmpdir(), 'pagedserve-chromium-'));
    context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium', headless: true, args: FLAGS,
      viewport: { width: 1200, height: 900 },
    });
    page = context.pages()[0] ?? await context.newPage();
    page.on('pageerror', (err) => { throw err; });
  });

  afterAll(async () => {
    await context?.close();
    rmSync(profile, { recursive: true, force: true });
  });

  it('plots live engine numbers while requests run', { timeout: 120_000 }, async () => {
    await page.goto(`${baseURL}/dashboard`);
    await expect.poll(() => page.textContent('#connection'), { timeout: 15_000 }).toBe('live');
    const last = (chart: string, series: string) => page.getAttribute(`[data-chart=${chart}] path[data-series="${series}"]`, 'data-last');
    await expect.poll(() => last('kv', 'engine 0'), { timeout: 15_000 }).toBe('0');
    // NOTE: staggered, so the plots have some shape by the time of the screenshot
    const load = Array.from({ length: 6 }, (_, i) => new Promise((r) => setTimeout(r, i * 1500)).then(() => fetch(`${baseURL}/v1/chat/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ messages: [{ role: 'user', content: `Story number ${i}` }], max_tokens: 300 + 100 * i, ignore_eos: true }),
    })).then((r) => r.json()));
    try {
      const moved = async () => Number(await last('tokens', 'out') || 0) > 0 && Number(await last('kv', 'engine 0') || 0) > 0
        && Number(await last('requests', 'running') || 0) > 0 && Number(await last('ttft', 'p50') || 0) > 0;
      await expect.poll(moved, { timeout: 60_000, interval: 250 }).toBe(true);
      // several seconds of samples under load, then the picture
      await expect.poll(async () => (await page.getAttribute('[data-chart=tokens] path[data-series="out"]', 'd'))?.split('L').length ?? 0,
        { timeout: 30_000, interval: 500 }).toBeGreaterThan(8);
      expect(Number(await page.textContent('#engines tbody tr td:nth-child(3)'))).toBeGreaterThan(0);
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard-load.png'), fullPage: true });
      await page.setViewportSize({ width: 390, height: 844 });
      await page.screenshot({ path: join(ARTIFACTS, 'dashboard-phone.png'), fullPage: true });
    } finally {
      await Promise.all(load);
    }
    expect(await waitIdle(baseURL)).toBe(0);
  });
});
