// The chat page's conversations, kept in this browser's localStorage (nothing leaves it).
// A conversation: { id, title, created, updated, messages: [{ role, content, reasoning?,
// tool_calls?: [{ id, name, arguments }], meta?, interrupted? }], pending? } where `pending`
// names the stream still writing its last message ({ requestId, lastEventId }).

const KEY = 'pagedserve.conversations.v1';
const CURRENT = 'pagedserve.current';

function read() {
  try {
    const list = JSON.parse(localStorage.getItem(KEY) ?? '[]');
    return Array.isArray(list) ? list.filter((c) => c && typeof c.id === 'string' && Array.isArray(c.messages)) : [];
  } catch {
    return []; // NOTE: a corrupt entry starts the list afresh rather than breaking the page
  }
}

export class Store {
  constructor() {
    this.conversations = read();
    this.currentId = localStorage.getItem(CURRENT);
    if (!this.get(this.currentId)) this.currentId = this.conversations[0]?.id ?? null;
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) ?? null;
  }

  get current() {
    return this.get(this.currentId);
  }

  /** Newest first. */
  sorted() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  create() {
    const now = Date.now();
    const conv = { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 8)}`, title: '', created: now, updated: now, messages: [], pending: null };
    this.conversations.push(conv);
    this.select(conv.id);
    return conv;
  }

  select(id) {
    this.currentId = id;
    if (id) localStorage.setItem(CURRENT, id);
    else localStorage.removeItem(CURRENT);
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.select(this.sorted()[0]?.id ?? null);
    this.save();
  }

  touch(conv) {
    conv.updated = Date.now();
    if (!conv.title) {
      const first = conv.messages.find((m) => m.role === 'user');
      if (first) conv.title = first.content.replace(/\s+/g, ' ').trim().slice(0, 60);
    }
  }

  save() {
    try {
      localStorage.setItem(KEY, JSON.stringify(this.conversations));
    } catch (err) {
      console.warn('could not save the conversations', err); // NOTE: quota: the page still works
    }
  }
}
