// A small Markdown renderer for model replies that builds DOM nodes only: every piece of model
// text reaches the page through textContent or a text node, never innerHTML, so HTML in a reply
// stays visible text; links are kept only for http(s) URLs and open with rel=noopener.
// Blocks: fenced code, headings, lists (nested by indent), quotes, tables, rules, paragraphs.
// Inline: `code`, **strong**, *em*, _em_, ~~del~~, [text](url), bare http(s) URLs.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w#+.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code span
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 3: strong
  /(?<![\w])__(?=\S)([\s\S]*?\S)__(?![\w])/.source, // 4: strong
  /~~(?=\S)([\s\S]*?\S)~~/.source, // 5: del
  /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 6: em
  /(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])/.source, // 7: em
  /\[([^\]\n]*)\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 8, 9: link
  /(https?:\/\/[^\s<>()\[\]]*[^\s<>()\[\].,;:!?'"*_~])/.source, // 10: bare URL
].join('|'), 'g');

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** An http(s) URL as a normalized string, or null for anything else (javascript:, data:, ...). */
export function safeHref(raw) {
  try {
    const url = new URL(raw);
    return url.protocol === 'http:' || url.protocol === 'https:' ? url.href : null;
  } catch {
    return null;
  }
}

function link(text, href, into) {
  const safe = safeHref(href);
  if (!safe) {
    into.append(text || href); // NOTE: an unsafe link keeps its words, loses the link
    return;
  }
  const a = el('a');
  a.href = safe;
  a.target = '_blank';
  a.rel = 'noopener noreferrer nofollow';
  inline(text || safe, a);
  into.append(a);
}

/** Append `text`'s inline Markdown to `into` as nodes. */
export function inline(text, into) {
  let at = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > at) into.append(text.slice(at, m.index));
    at = m.index + m[0].length;
    if (m[1] !== undefined) into.append(el('code', null, m[2].replace(/^ (.*) $/s, '$1')));
    else if (m[3] !== undefined || m[4] !== undefined) inline(m[3] ?? m[4], into.appendChild(el('strong')));
    else if (m[5] !== undefined) inline(m[5], into.appendChild(el('del')));
    else if (m[6] !== undefined || m[7] !== undefined) inline(m[6] ?? m[7], into.appendChild(el('em')));
    else if (m[8] !== undefined) link(m[8], m[9], into);
    else link(m[10], m[10], into);
  }
  if (at < text.length) into.append(text.slice(at));
}

function paragraph(lines, into) {
  const p = el('p');
  lines.forEach((line, i) => {
    if (i > 0) p.append(el('br'));
    inline(line.trim(), p);
  });
  into.append(p);
}

function codeBlock(lang, lines, into) {
  const box = el('div', 'code');
  const bar = el('div', 'code-bar');
  bar.append(el('span', 'code-lang', lang || 'text'));
  const copy = el('button', 'copy', 'Copy');
  copy.type = 'button';
  bar.append(copy);
  const pre = el('pre');
  const code = el('code', lang ? `language-${lang}` : null, lines.join('\n'));
  pre.append(code);
  copy.addEventListener('click', () => {
    void navigator.clipboard?.writeText(code.textContent ?? '').then(() => {
      copy.textContent = 'Copied';
      setTimeout(() => { copy.textContent = 'Copy'; }, 1200);
    }, () => undefined);
  });
  box.append(bar, pre);
  into.append(box);
}

function cells(line) {
  return line.trim().replace(/^\|/, '').replace(/\|$/, '').split('|').map((c) => c.trim());
}

function table(lines, into) {
  const wrap = el('div', 'table');
  const t = el('table');
  const head = t.createTHead().insertRow();
  for (const c of cells(lines[0])) inline(c, head.appendChild(el('th')));
  const body = t.createTBody();
  for (const line of lines.slice(2)) {
    const row = body.insertRow();
    for (const c of cells(line)) inline(c, row.appendChild(el('td')));
  }
  wrap.append(t);
  into.append(wrap);
}

function list(lines, start, into) {
  const first = lines[start].match(ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? 'ol' : 'ul');
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  const entries = []; // each item's lines, dedented
  let i = start;
  for (; i < lines.length; i++) {
    const line = lines[i];
    const m = line.match(ITEM);
    const body = entries[entries.length - 1];
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) entries.push([m[3]]);
    else if (m && m[1].length < indent) break;
    else if (line.trim() === '') {
      const next = lines[i + 1] ?? '';
      if (!/^\s+\S/.test(next) && !ITEM.test(next)) break;
      body.push('');
    } else if (/^\s+\S/.test(line)) body.push(line.slice(Math.min(indent + 2, line.search(/\S/))));
    else if (!m && body[body.length - 1] !== '') body.push(line); // NOTE: a lazy continuation
    else break;
  }
  for (const body of entries) blocks(body, node.appendChild(el('li')), true);
  into.append(node);
  return i;
}

function isTable(lines, i) {
  return lines[i].includes('|') && TABLE_SEP.test(lines[i + 1] ?? '') && lines[i + 1].includes('-');
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line) || isTable(lines, i);
}

/** Render `lines` as blocks into `into`; `tight`: one plain paragraph becomes bare text. */
function blocks(lines, into, tight = false) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (line.trim() === '') { i++; continue; }
    if ((m = line.match(FENCE))) {
      const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      i++; // NOTE: past the closing fence; an open fence (still streaming) runs to the end
      codeBlock(m[2], body, into);
    } else if ((m = line.match(HEADING))) {
      inline(m[2], into.appendChild(el(`h${Math.min(m[1].length + 2, 6)}`)));
      i++;
    } else if (RULE.test(line)) {
      into.append(el('hr'));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ''));
      blocks(body, into.appendChild(el('blockquote')));
    } else if (ITEM.test(line)) {
      i = list(lines, i, into);
    } else if (isTable(lines, i)) {
      const rows = [line, lines[i + 1]];
      for (i += 2; i < lines.length && lines[i].includes('|') && lines[i].trim() !== ''; i++) rows.push(lines[i]);
      table(rows, into);
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() !== '' && (para.length === 0 || !startsBlock(lines, i)); i++) para.push(lines[i]);
      if (tight && i >= lines.length && into.childNodes.length === 0) {
        para.forEach((l, k) => { if (k > 0) into.append(el('br')); inline(l.trim(), into); });
      } else {
        paragraph(para, into);
      }
    }
  }
}

/** A fragment holding `text` rendered as Markdown (inert: no HTML of the text is parsed). */
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  blocks(String(text).replace(/\r\n?/g, '\n').split('\n'), frag);
  return frag;
}
