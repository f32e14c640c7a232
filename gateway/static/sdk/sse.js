/** A small pure Server-Sent Events parser: feed it bytes split anywhere, get whole events out. */
const CR = 0x0d;
const LF = 0x0a;
/** Incremental parser (WHATWG event-stream rules): lines end in CRLF, LF or CR; `:` lines are
 * comments; a blank line dispatches the event; an unfinished event at the end is dropped. */
export class SSEDecoder {
    buf = new Uint8Array(0);
    data = [];
    event = null;
    id = null;
    retry = null;
    // NOTE: whole lines are decoded, so a character split across chunks arrives intact.
    text = new TextDecoder();
    feed(chunk) {
        const joined = new Uint8Array(this.buf.length + chunk.length);
        joined.set(this.buf);
        joined.set(chunk, this.buf.length);
        const events = [];
        let start = 0;
        for (let i = 0; i < joined.length; i++) {
            const byte = joined[i];
            if (byte !== CR && byte !== LF)
                continue;
            if (byte === CR && i === joined.length - 1)
                break; // NOTE: may be the first half of a CRLF
            const event = this.line(this.text.decode(joined.subarray(start, i)));
            if (event)
                events.push(event);
            if (byte === CR && joined[i + 1] === LF)
                i++;
            start = i + 1;
        }
        this.buf = joined.slice(start);
        return events;
    }
    line(line) {
        if (line === '')
            return this.dispatch();
        if (line.startsWith(':'))
            return null;
        const colon = line.indexOf(':');
        const name = colon === -1 ? line : line.slice(0, colon);
        let value = colon === -1 ? '' : line.slice(colon + 1);
        if (value.startsWith(' '))
            value = value.slice(1);
        if (name === 'data')
            this.data.push(value);
        else if (name === 'event')
            this.event = value;
        else if (name === 'id' && !value.includes('\0'))
            this.id = value;
        else if (name === 'retry' && /^\d+$/.test(value))
            this.retry = Number(value);
        return null;
    }
    dispatch() {
        if (this.data.length === 0 && this.event === null)
            return null;
        const event = { data: this.data.join('\n'), event: this.event, id: this.id, retry: this.retry };
        this.data = [];
        this.event = null;
        this.retry = null;
        return event;
    }
}
/** Events of a byte stream (a fetch body); cancels the stream if the consumer stops early. */
export async function* iterEvents(body) {
    const reader = body.getReader();
    const decoder = new SSEDecoder();
    try {
        for (;;) {
            const { done, value } = await reader.read();
            if (done)
                return;
            yield* decoder.feed(value);
        }
    }
    finally {
        await reader.cancel().catch(() => undefined);
    }
}
