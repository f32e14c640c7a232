// The live engine view: reads GET /v1/stats/stream (SSE, one JSON snapshot a second, the last
// five minutes first) and plots it as inline SVG; numbers reach the page through textContent.
import { APIError, PagedServe, iterEvents } from './sdk/index.js';

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = 'pagedserve.apiKey'; // NOTE: shared with the chat page
const SPAN_S = 300; // the most the plots show; less while the history is shorter
const MIN_SPAN_S = 60;
const COLORS = ['#3b5bdb', '#e8590c', '#2b8a3e', '#ae3ec9', '#0c8599', '#c92a2a'];
const SVG = 'http://www.w3.org/2000/svg';
const snapshots = [];
let generation = 0; // bumps on reconnect, so an old reader stops

const sum = (snap, field) => snap.engines.reduce((t, e) => t + (e[field] ?? 0), 0);
const pct = (v) => (v === null || v === undefined ? null : v * 100);
const ms = (v) => (v === null || v === undefined ? null : v * 1000);
const perEngine = (field, scale) => (snaps) => {
  const names = [...new Set(snaps.flatMap((s) => s.engines.map((e) => e.engine)))];
  return names.map((name) => ({ key: name, label: name, value: (s) => scale(s.engines.find((e) => e.engine === name)?.[field]) }));
};
const fixed = (series) => () => series;

// Each chart: the series it draws (a function of the snapshots: engines come and go).
const CHARTS = [
  { id: 'kv', title: 'KV-cache utilization', unit: '%', cap: 100, series: perEngine('kv_cache_usage', pct) },
  { id: 'requests', title: 'Requests', unit: '', series: fixed([
    { key: 'running', label: 'running', value: (s) => sum(s, 'running') },
    { key: 'waiting', label: 'waiting', value: (s) => sum(s, 'waiting') },
    { key: 'swapped', label: 'swapped', value: (s) => sum(s, 'swapped') }]) },
  { id: 'tokens', title: 'Tokens per second', unit: 'tok/s', series: fixed([
    { key: 'in', label: 'prompt (in)', value: (s) => sum(s, 'prompt_tokens_per_s') },
    { key: 'out', label: 'output (out)', value: (s) => sum(s, 'generation_tokens_per_s') }]) },
  { id: 'prefix', title: 'Prefix-cache hit rate', unit: '%', max: 100, series: perEngine('prefix_cache_hit_rate', pct) },
  { id: 'ttft', title: 'Time to first token', unit: 'ms', note: 'last 30 s', series: fixed(['p50', 'p90', 'p99'].map((p) => (
    { key: p, label: p, value: (s) => ms(s.ttft_seconds?.[p]) }))) },
  { id: 'itl', title: 'Inter-token latency', unit: 'ms', note: 'last 30 s', series: fixed(['p50', 'p90', 'p99'].map((p) => (
    { key: p, label: p, value: (s) => ms(s.itl_seconds?.[p]) }))) },
];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v, unit) {
  if (v === null || v === undefined || Number.isNaN(v)) return '–';
  const digits = Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
  return `${v.toFixed(unit === '' ? 0 : digits)}`;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map((m) => m * p).find((m) => m >= v);
}

function buildCharts() {
  for (const chart of CHARTS) {
    const card = el('section', 'card');
    card.dataset.chart = chart.id;
    const h = el('h2', null, chart.title);
    h.append(el('small', null, chart.unit ? `${chart.unit}${chart.note ? ` · ${chart.note}` : ''}` : 'all engines'));
    const nows = el('div', 'nows');
    const plot = el('div', 'plot');
    const svg = document.createElementNS(SVG, 'svg');
    svg.setAttribute('viewBox', '0 0 300 100');
    svg.setAttribute('preserveAspectRatio', 'none');
    for (const y of [0, 25, 50, 75, 100]) {
      const line = document.createElementNS(SVG, 'line');
      line.setAttribute('class', 'grid');
      line.setAttribute('x1', '0'); line.setAttribute('x2', '300');
      line.setAttribute('y1', String(y)); line.setAttribute('y2', String(y));
      line.setAttribute('vector-effect', 'non-scaling-stroke');
      svg.append(line);
    }
    const ymax = el('span', 'ymax');
    plot.append(svg, ymax, el('span', 'ymin', '0'));
    const axis = el('div', 'axis');
    const since = el('span', null, '');
    axis.append(since, el('span', null, 'now'));
    card.append(h, nows, plot, axis);
    $('charts').append(card);
    Object.assign(chart, { card, nows, svg, ymax, since });
  }
}

function pathOf(snaps, value, now, top, span) {
  let d = '';
  let pen = false;
  for (const s of snaps) {
    const v = value(s);
    const x = 300 - ((now - s.time) / span) * 300;
    if (v === null || v === undefined || x < 0) { pen = false; continue; }
    const y = 100 - Math.min(v / top, 1) * 100;
    // NOTE: `l0 0` after a move draws a dot (round caps), so a lone sample still shows
    d += pen ? `L${x.toFixed(1)} ${y.toFixed(2)} ` : `M${x.toFixed(1)} ${y.toFixed(2)} l0 0 `;
    pen = true;
  }
  return d.trim();
}

function drawChart(chart, snaps, now, span) {
  const series = chart.series(snaps);
  const last = snaps[snaps.length - 1];
  const peak = Math.max(0, ...series.flatMap((s) => snaps.map(s.value).filter((v) => v !== null && v !== undefined)));
  const top = chart.max ?? Math.min(chart.cap ?? Infinity, niceMax(peak));
  chart.ymax.textContent = `${+top.toPrecision(3)}${chart.unit === '%' ? '%' : ''}`;
  chart.svg.querySelectorAll('path').forEach((p) => p.remove());
  chart.nows.replaceChildren();
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const path = document.createElementNS(SVG, 'path');
    path.setAttribute('d', pathOf(snaps, s.value, now, top, span));
    path.setAttribute('stroke', color);
    path.dataset.series = s.key;
    const v = last ? s.value(last) : null;
    path.dataset.last = v === null || v === undefined ? '' : String(v);
    chart.svg.append(path);
    const now_ = el('span', 'now');
    now_.dataset.series = s.key;
    now_.style.setProperty('--c', color);
    now_.append(el('b', null, `${fmt(v, chart.unit)}${chart.unit === '%' && v !== null && v !== undefined ? '%' : ''}`), el('i', null, s.label));
    chart.nows.append(now_);
  });
}

function engineRow(e) {
  const row = el('tr');
  const cells = [e.engine, `${fmt(pct(e.kv_cache_usage), '%')}% (${e.kv_blocks_used}/${e.kv_blocks_total})`,
    e.running, e.waiting, e.swapped, fmt(e.prompt_tokens_per_s, 'tok/s'), fmt(e.generation_tokens_per_s, 'tok/s'),
    e.prefix_cache_hit_rate_total === null ? '–' : `${fmt(pct(e.prefix_cache_hit_rate_total), '%')}%`, e.preemptions];
  for (const c of cells) row.append(el('td', null, String(c)));
  return row;
}

function draw() {
  const last = snapshots[snapshots.length - 1];
  if (!last) return;
  const now = last.time;
  while (snapshots.length && snapshots[0].time < now - SPAN_S - 2) snapshots.shift();
  const span = Math.min(SPAN_S, Math.max(MIN_SPAN_S, Math.ceil((now - snapshots[0].time) / 60) * 60));
  for (const chart of CHARTS) {
    drawChart(chart, snapshots, now, span);
    chart.since.textContent = `${span / 60} min ago`;
  }
  $('engines').tBodies[0].replaceChildren(...last.engines.map(engineRow));
  const n = last.engines.length;
  $('summary').textContent = `${n} engine${n === 1 ? '' : 's'} · ${last.requests_in_flight} requests in flight · updated ${new Date(now * 1000).toLocaleTimeString()}`;
}

function setConnection(text, state) {
  $('connection').textContent = text;
  $('connection').className = `pill ${state}`;
}

async function follow() {
  const mine = ++generation;
  const client = new PagedServe({ baseURL: location.origin, maxRetries: 0, apiKey: localStorage.getItem(KEY_STORAGE) || null });
  try {
    const { response } = await client.request('GET', '/v1/stats/stream', undefined);
    setConnection('live', 'ok');
    $('error').hidden = true;
    for await (const event of iterEvents(response.body)) {
      if (mine !== generation) return;
      const data = JSON.parse(event.data);
      if (event.event === 'history') snapshots.splice(0, snapshots.length, ...data);
      else snapshots.push(data);
      draw();
    }
  } catch (err) {
    if (mine !== generation) return;
    setConnection('offline', 'bad');
    $('error').textContent = err instanceof APIError && err.code === 'invalid_api_key'
      ? 'This server needs an API key: enter it at the top.'
      : `Lost the stats stream (${err?.message ?? err}); reconnecting…`;
    $('error').hidden = false;
    if (err instanceof APIError && err.code === 'invalid_api_key') return;
  }
  if (mine !== generation) return;
  setConnection('reconnecting…', '');
  setTimeout(() => { if (mine === generation) void follow(); }, 2000);
}

$('api-key').value = localStorage.getItem(KEY_STORAGE) ?? '';
$('api-key').addEventListener('change', () => {
  const key = $('api-key').value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  void follow();
});
buildCharts();
void follow();
