// The chat page: conversations kept in localStorage, replies streamed over SSE as resumable
// streams (POST /v1/chat/completions with `resumable`, resumed by GET /v1/streams/{id} after a
// network drop or a reload: docs/resume.md) through the TypeScript SDK's browser build (./sdk/,
// compiled from clients/typescript/src by `npm run build:browser`), rendered by ./markdown.js
// (DOM nodes only, never innerHTML).
import { APIConnectionError, APIError, APIUserAbortError, PagedServe } from './sdk/index.js';
import { renderMarkdown } from './markdown.js';
import { Reply, follow } from './reply.js';
import { Store } from './store.js';

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = 'pagedserve.apiKey';
const SETTINGS_STORAGE = 'pagedserve.settings';
const store = new Store();
let client = newClient();
let running = null; // the Reply being streamed, if any

const PLAIN = {
  context_length_exceeded: 'This conversation is too long for the model. Lower "Max tokens" or start a new chat.',
  model_not_found: 'The server no longer serves this model. Reload the page to pick another.',
  invalid_value: 'One of the settings is out of range.',
  unsupported_value: 'One of the settings is not supported by this server.',
  server_draining: 'The server is restarting. Try again in a few seconds.',
  server_overloaded: 'The server is busy. Try again in a few seconds.',
  engine_unavailable: 'The model engine is not running right now. Try again in a few seconds.',
  engine_error: 'The model engine failed while answering. Try again.',
  invalid_api_key: 'This server needs an API key: enter it in the API key field at the bottom of the sidebar.',
  stream_expired: 'The answer could not be resumed: the server let it go while the connection was down.',
  stream_not_found: 'The answer could not be resumed: the server no longer knows it.',
};

function newClient() {
  return new PagedServe({ baseURL: location.origin, maxRetries: 1, apiKey: localStorage.getItem(KEY_STORAGE) || null });
}

function plainWords(err) {
  if (err instanceof APIConnectionError) return 'Lost the connection to the server. Check that it is running, then try again.';
  if (err instanceof APIError) {
    const sentence = PLAIN[err.code] ?? 'The server could not answer.';
    return `${sentence} (Server said: ${err.message})`;
  }
  return `Something went wrong: ${err?.message ?? err}`;
}

function showError(err) {
  $('error').textContent = plainWords(err);
  $('error').hidden = false;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, className, onClick, title) {
  const b = el('button', className, label);
  b.type = 'button';
  if (title) b.title = title;
  b.addEventListener('click', onClick);
  return b;
}

// ---- rendering ------------------------------------------------------------------------------

function toolCallNode(call) {
  const box = el('div', 'tool-call');
  const head = el('div', 'tool-head');
  head.append(el('span', 'tool-badge', 'tool call'), el('code', 'tool-name', call.name || '…'));
  let args = call.arguments ?? '';
  try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* NOTE: still streaming */ }
  box.append(head, el('pre', 'tool-args', args));
  return box;
}

function assistantBody(msg, node, streaming) {
  if (msg.reasoning) {
    const details = el('details', 'reasoning');
    details.open = Boolean(node.querySelector('details.reasoning')?.open);
    details.append(el('summary', null, streaming && !msg.content ? 'Thinking…' : 'Reasoning'), el('div', 'reasoning-body', msg.reasoning));
    node.append(details);
  }
  const content = el('div', 'content markdown');
  content.append(renderMarkdown(msg.content ?? ''));
  node.append(content);
  if (msg.tool_calls?.length) {
    const calls = el('div', 'tool-calls');
    for (const call of msg.tool_calls) calls.append(toolCallNode(call));
    node.append(calls);
  }
}

function messageNode(conv, msg, index) {
  const node = el('article', `msg ${msg.role}`);
  node.dataset.role = msg.role;
  node.dataset.index = String(index);
  fillMessage(conv, msg, index, node);
  return node;
}

function fillMessage(conv, msg, index, node) {
  const streaming = running?.conv === conv && running.msg === msg;
  const body = el('div', 'bubble');
  if (msg.role === 'assistant') assistantBody(msg, body, streaming);
  else body.append(el('div', 'content', msg.content));
  const last = index === conv.messages.length - 1;
  const lastUser = msg.role === 'user' && conv.messages.slice(index + 1).every((m) => m.role !== 'user');
  const foot = el('div', 'msg-foot');
  if (msg.interrupted) foot.append(el('span', 'note', msg.interrupted));
  if (msg.meta) foot.append(el('span', 'meta', msg.meta));
  if (!streaming && !running) {
    const actions = el('div', 'actions');
    if (msg.role === 'assistant') actions.append(button('Copy', 'copy-msg', () => void navigator.clipboard?.writeText(msg.content ?? '')));
    if (msg.role === 'assistant' && last) actions.append(button('Regenerate', 'regenerate', () => void regenerate(conv), 'Ask for another answer'));
    if (lastUser) actions.append(button('Edit', 'edit', () => editMessage(conv, index, node), 'Edit and send again'));
    foot.append(actions);
  }
  node.classList.toggle('streaming', streaming);
  node.replaceChildren(body, foot);
}

function renderTranscript() {
  const conv = store.current;
  const box = $('transcript');
  box.replaceChildren();
  $('title').textContent = conv?.title || 'New chat';
  if (!conv || conv.messages.length === 0) {
    const empty = el('div', 'empty');
    empty.append(el('h2', null, 'How can I help?'), el('p', null, `Chatting with ${$('model').value || 'the served model'}. Enter sends, Shift+Enter adds a line.`));
    box.append(empty);
    return;
  }
  conv.messages.forEach((msg, i) => box.append(messageNode(conv, msg, i)));
  box.scrollTop = box.scrollHeight;
}

function renderList() {
  const list = $('conversations');
  list.replaceChildren();
  for (const conv of store.sorted()) {
    const item = el('li', conv.id === store.currentId ? 'active' : null);
    item.dataset.id = conv.id;
    item.append(button(conv.title || 'New chat', 'open', () => switchTo(conv.id)),
      button('✕', 'delete', () => removeConversation(conv.id), 'Delete this conversation'));
    list.append(item);
  }
}

function render() {
  renderList();
  renderTranscript();
}

/** Re-render the streaming message at most once a frame. */
function scheduleUpdate(reply) {
  if (reply.frame) return;
  reply.frame = requestAnimationFrame(() => {
    reply.frame = 0;
    if (store.currentId !== reply.conv.id) return;
    const node = $('transcript').querySelector(`.msg[data-index="${reply.conv.messages.indexOf(reply.msg)}"]`);
    if (!node) return;
    const box = $('transcript');
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    fillMessage(reply.conv, reply.msg, reply.conv.messages.indexOf(reply.msg), node);
    if (atBottom) box.scrollTop = box.scrollHeight;
  });
}

// ---- streaming ------------------------------------------------------------------------------

function settings() {
  const seed = $('seed').value.trim();
  return {
    model: $('model').value || undefined,
    max_tokens: Number($('max-tokens').value) || undefined,
    temperature: Number($('temperature').value),
    ...(seed === '' ? {} : { seed: Number(seed) }),
  };
}

function apiMessages(messages) {
  return messages.map((m) => {
    const out = { role: m.role, content: m.content ?? '' };
    if (m.tool_calls?.length) {
      out.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: 'function', function: { name: c.name, arguments: c.arguments } }));
    }
    return out;
  });
}

const replyHooks = {
  save: () => store.save(),
  onEvent(reply) {
    $('stats').textContent = reply.stats();
    scheduleUpdate(reply);
  },
  onConnection(state) {
    if (state === 'reconnecting') {
      document.body.dataset.resumes = String(Number(document.body.dataset.resumes ?? 0) + 1);
      setConnection('reconnecting…', '');
    } else {
      setConnection('connected', 'ok');
    }
  },
};

/** Stream `reply` to its end: `open` gives the first response (null: resume at once). */
async function drive(reply, open) {
  const { conv, msg } = reply;
  running = reply;
  setRunning(true);
  render();
  let status = 'error';
  try {
    await follow(reply, await open(), client);
    status = reply.stopped ? 'stopped' : `finished (${reply.finish ?? 'done'})`;
  } catch (err) {
    if (reply.stopped || err instanceof APIUserAbortError || reply.controller.signal.aborted) status = 'stopped';
    else {
      showError(err);
      if (msg.content || msg.reasoning) msg.interrupted = 'The answer was cut off.';
    }
  } finally {
    conv.pending = null;
    running = null;
    const meta = reply.stats(status);
    $('stats').textContent = meta;
    if (!msg.content && !msg.reasoning && !msg.tool_calls?.length && status === 'error') conv.messages.pop();
    else msg.meta = meta;
    store.touch(conv);
    store.save();
    setRunning(false);
    render();
  }
}

function stream(conv) {
  const history = apiMessages(conv.messages);
  const msg = { role: 'assistant', content: '' };
  conv.messages.push(msg);
  const reply = new Reply(conv, msg, replyHooks);
  return drive(reply, async () => {
    const body = { ...settings(), messages: history, stream: true, resumable: true, stream_options: { include_usage: true } };
    const { response } = await client.request('POST', '/v1/chat/completions', body, { signal: reply.controller.signal });
    reply.requestId = response.headers.get('x-request-id');
    conv.pending = { requestId: reply.requestId, streamId: response.headers.get('x-stream-id'), lastEventId: null };
    store.save();
    return response;
  });
}

function setRunning(on) {
  $('send').disabled = on;
  $('stop').disabled = !on;
  document.body.dataset.state = on ? 'generating' : 'idle';
}

async function stop() {
  const reply = running;
  if (!reply) return;
  reply.stopped = true;
  // NOTE: cancel on the server first: a resumable stream outlives its connection there
  const streamId = reply.conv.pending?.streamId;
  if (streamId) await client.request('DELETE', `/v1/streams/${encodeURIComponent(streamId)}`, undefined).catch(() => undefined);
  else if (reply.requestId) await client.cancel(reply.requestId).catch(() => undefined);
  reply.controller.abort();
}

// ---- actions --------------------------------------------------------------------------------

function send(text) {
  $('error').hidden = true;
  const conv = store.current ?? store.create();
  conv.messages.push({ role: 'user', content: text });
  store.touch(conv);
  store.save();
  void stream(conv);
}

async function regenerate(conv) {
  if (running) return;
  $('error').hidden = true;
  while (conv.messages.length && conv.messages[conv.messages.length - 1].role !== 'user') conv.messages.pop();
  if (conv.messages.length) await stream(conv);
}

function editMessage(conv, index, node) {
  const msg = conv.messages[index];
  const area = el('textarea', 'edit-box');
  area.value = msg.content;
  area.rows = Math.min(12, Math.max(2, msg.content.split('\n').length));
  const save = button('Save & send', 'save-edit primary', () => {
    const text = area.value.trim();
    if (!text) return;
    conv.messages.length = index + 1;
    msg.content = text;
    if (index === conv.messages.findIndex((m) => m.role === 'user')) conv.title = '';
    store.touch(conv);
    void regenerate(conv);
  });
  const cancel = button('Cancel', 'cancel-edit', () => renderTranscript());
  const bar = el('div', 'actions');
  bar.append(cancel, save);
  node.replaceChildren(area, bar);
  area.focus();
}

function switchTo(id) {
  for (const c of store.conversations) if (c.id !== id && c.messages.length === 0) store.remove(c.id);
  store.select(id);
  document.body.classList.remove('nav-open');
  $('error').hidden = true;
  render();
}

function removeConversation(id) {
  if (running?.conv.id === id) return;
  store.remove(id);
  render();
}

/** After a reload: resume the stream that was writing a message (the first, if several were:
 * one runs at a time); a message whose stream cannot be resumed keeps its text and says so. */
function resumeAfterReload() {
  let resumed = null;
  for (const conv of store.conversations) {
    if (!conv.pending) continue;
    const msg = conv.messages[conv.messages.length - 1];
    if (!resumed && conv.pending.streamId && msg?.role === 'assistant') {
      resumed = new Reply(conv, msg, replyHooks);
      resumed.requestId = conv.pending.requestId;
      continue;
    }
    if (msg?.role === 'assistant') msg.interrupted = 'The answer stopped when the page was reloaded.';
    conv.pending = null;
  }
  store.save();
  if (resumed) void drive(resumed, async () => null);
}

// ---- settings and start -----------------------------------------------------------------------

function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) ?? '{}');
    for (const id of ['max-tokens', 'temperature', 'seed']) if (typeof saved[id] === 'string') $(id).value = saved[id];
  } catch { /* NOTE: defaults */ }
  $('api-key').value = localStorage.getItem(KEY_STORAGE) ?? '';
}

function saveSettings() {
  const saved = {};
  for (const id of ['max-tokens', 'temperature', 'seed']) saved[id] = $(id).value;
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(saved));
}

function setConnection(text, state) {
  $('connection').textContent = text;
  $('connection').className = `pill ${state}`;
}

/** A model's entry in the picker; an adapter (a card with a `parent`) says whose it is. */
function modelOption(m) {
  return new Option(m.parent ? `${m.id} (adapter of ${m.parent})` : m.id, m.id);
}

async function loadModels() {
  try {
    const models = await client.models.list();
    const picked = $('model').value;
    const options = models.data.map(modelOption);
    $('model').replaceChildren(...options);
    // NOTE: a reload of the list (reconnect) keeps the model picked, while it is served
    if (options.some((o) => o.value === picked)) $('model').value = picked;
    setConnection('connected', 'ok');
    $('error').hidden = true;
    if (!store.current?.messages.length) renderTranscript();
  } catch (err) {
    setConnection('offline', 'bad');
    showError(err);
  }
}

$('composer').addEventListener('submit', (event) => {
  event.preventDefault();
  const text = $('prompt').value.trim();
  if (!text || running) return;
  $('prompt').value = '';
  send(text);
});
$('prompt').addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $('composer').requestSubmit();
  }
});
$('stop').addEventListener('click', () => void stop());
$('new-chat').addEventListener('click', () => {
  if (!store.current || store.current.messages.length) store.create();
  switchTo(store.currentId);
  $('prompt').focus();
});
$('menu').addEventListener('click', () => document.body.classList.toggle('nav-open'));
$('scrim').addEventListener('click', () => document.body.classList.remove('nav-open'));
for (const id of ['max-tokens', 'temperature', 'seed']) $(id).addEventListener('change', saveSettings);
$('api-key').addEventListener('change', () => {
  const key = $('api-key').value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  client = newClient();
  void loadModels();
});
addEventListener('offline', () => setConnection('offline', 'bad'));
addEventListener('online', () => void loadModels());

addEventListener('pagehide', () => store.save());

loadSettings();
setRunning(false);
render();
resumeAfterReload();
void loadModels();
