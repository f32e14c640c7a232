// The chat page: streams replies over the pagedserve.v1 WebSocket through the TypeScript SDK's
// browser build (./sdk/, compiled from clients/typescript/src by `npm run build:browser`).
import { APIConnectionError, APIError, PagedServe, chunkText } from './sdk/index.js';

const $ = (id) => document.getElementById(id);
const client = new PagedServe({ baseURL: location.origin, maxRetries: 1 });
const socket = client.websocket();
const conversation = [];
let running = null; // { gen, start, first, tokens, bubble }

const PLAIN = {
  context_length_exceeded: 'This conversation is too long for the model. Lower "Max tokens" or reload the page to start over.',
  model_not_found: 'The server no longer serves this model. Reload the page to pick another.',
  invalid_value: 'One of the settings is out of range.',
  unsupported_value: 'One of the settings is not supported by this server.',
  server_draining: 'The server is restarting. Try again in a few seconds.',
  server_overloaded: 'The server is busy. Try again in a few seconds.',
  engine_unavailable: 'The model engine is not running right now. Try again in a few seconds.',
  engine_error: 'The model engine failed while answering. Try again.',
  too_many_generations: 'Too many replies are running at once. Wait for one to finish.',
  invalid_api_key: 'This server needs an API key; the chat page cannot send one.',
};

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

function bubble(role, text) {
  const el = document.createElement('div');
  el.className = `msg ${role}`;
  el.dataset.role = role;
  el.textContent = text;
  $('transcript').append(el);
  el.scrollIntoView({ block: 'end' });
  return el;
}

function showStats(r, status) {
  const now = performance.now();
  const ttft = r.first === null ? '–' : `${Math.round(r.first - r.start)} ms`;
  const seconds = r.first === null ? 0 : (now - r.first) / 1000;
  const rate = seconds > 0 && r.tokens > 1 ? ((r.tokens - 1) / seconds).toFixed(1) : '–';
  $('stats').textContent = `TTFT ${ttft} · ${rate} tokens/s · ${r.tokens} tokens${status ? ` · ${status}` : ''}`;
}

function setRunning(on) {
  $('send').disabled = on;
  $('stop').disabled = !on;
  document.body.dataset.state = on ? 'generating' : 'idle';
}

async function send(text) {
  $('error').hidden = true;
  conversation.push({ role: 'user', content: text });
  bubble('user', text);
  const out = bubble('assistant', '');
  out.classList.add('streaming');
  const r = { gen: null, start: performance.now(), first: null, tokens: 0, bubble: out };
  running = r;
  setRunning(true);
  let status = 'error';
  try {
    r.gen = await socket.generate({
      model: $('model').value || undefined,
      messages: conversation,
      max_tokens: Number($('max-tokens').value) || undefined,
      temperature: Number($('temperature').value),
    });
    for await (const chunk of r.gen) {
      const piece = chunkText(chunk);
      if (!piece) continue;
      r.first ??= performance.now();
      r.tokens += 1; // NOTE: an estimate while streaming (a slow reader gets merged deltas)
      out.textContent += piece;
      out.scrollIntoView({ block: 'end' });
      showStats(r);
    }
    const done = r.gen.done;
    r.tokens = done?.usage?.completion_tokens ?? r.tokens;
    status = done?.status === 'cancelled' ? 'stopped' : `finished (${done?.finish_reason ?? 'done'})`;
  } catch (err) {
    showError(err);
  } finally {
    out.classList.remove('streaming');
    if (out.textContent) conversation.push({ role: 'assistant', content: out.textContent });
    else if (status === 'error') { out.remove(); conversation.pop(); }
    showStats(r, status);
    running = null;
    setRunning(false);
  }
}

async function loadModels() {
  try {
    const models = await client.models.list();
    for (const m of models.data) $('model').append(new Option(m.id, m.id));
    await socket.connect();
    $('connection').textContent = 'connected';
    $('connection').className = 'pill ok';
  } catch (err) {
    $('connection').textContent = 'offline';
    $('connection').className = 'pill bad';
    showError(err);
  }
}

$('composer').addEventListener('submit', (event) => {
  event.preventDefault();
  const text = $('prompt').value.trim();
  if (!text || running) return;
  $('prompt').value = '';
  void send(text);
});
$('prompt').addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey) {
    event.preventDefault();
    $('composer').requestSubmit();
  }
});
$('stop').addEventListener('click', () => running?.gen?.cancel());
setRunning(false);
void loadModels();
