import OpenAI from 'openai';
import { describe, expect, inject, it } from 'vitest';
import * as ps from '../src/index.js';

const baseURL = inject('baseURL');
const TEXTS = ['The cat sat on the mat.', 'Paged attention keeps the KV cache in blocks.', 'A dog ran', 'Vectors'];

function cosine(a: number[], b: number[]): number {
  let dot = 0, na = 0, nb = 0;
  for (let i = 0; i < a.length; i++) { dot += a[i] * b[i]; na += a[i] * a[i]; nb += b[i] * b[i]; }
  return dot / Math.sqrt(na * nb);
}

describe('embeddings, rerank and score against a real server', () => {
  const client = new ps.PagedServe({ baseURL, maxRetries: 0 });
  const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused', maxRetries: 0 });

  it('embeds as the openai SDK reads it, float and base64', async () => {
    // NOTE: openai's create asks for base64 unless told otherwise, and decodes it itself
    const reference = await openai.embeddings.create({ model: 'tiny-llama', input: TEXTS });
    const floats = await client.embeddings.create({ input: TEXTS, encoding_format: 'float' });
    const b64 = await client.embeddings.create({ input: TEXTS, encoding_format: 'base64' });
    expect(floats.data.map((d) => d.index)).toEqual([0, 1, 2, 3]);
    expect(floats.usage.prompt_tokens).toBe(reference.usage.prompt_tokens);
    for (let i = 0; i < TEXTS.length; i++) {
      const want = reference.data[i].embedding;
      expect(floats.data[i].embedding.length).toBe(want.length);
      floats.data[i].embedding.forEach((x, j) => expect(x).toBeCloseTo(want[j], 6));
      b64.data[i].embedding.forEach((x, j) => expect(x).toBeCloseTo(want[j], 6));
    }
  });

  it('reranks and scores by the embeddings\' cosine', async () => {
    const vectors = (await client.embeddings.create({ input: TEXTS, encoding_format: 'float' })).data.map((d) => d.embedding);
    const want = [1, 2, 3].map((j) => cosine(vectors[0], vectors[j]));
    const ranked = await client.rerank({ query: TEXTS[0], documents: [TEXTS[1], { text: TEXTS[2] }, TEXTS[3]], top_n: 2 });
    const order = [0, 1, 2].sort((a, b) => want[b] - want[a]);
    expect(ranked.results.map((r) => r.index)).toEqual(order.slice(0, 2));
    for (const r of ranked.results) {
      expect(r.relevance_score).toBeCloseTo(want[r.index], 4);
      expect(r.document?.text).toBe(TEXTS[r.index + 1]);
    }
    const scores = await client.score({ text_1: TEXTS[0], text_2: TEXTS.slice(1) });
    scores.data.forEach((d, i) => expect(d.score).toBeCloseTo(want[i], 4));
  });

  it('names the field of a bad request', async () => {
    const err = await client.embeddings.create({ input: [] }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ps.BadRequestError);
    expect((err as ps.BadRequestError).param).toBe('input');
    const dims = await client.embeddings.create({ input: 'x', dimensions: 3 }).catch((e: unknown) => e);
    expect((dims as ps.BadRequestError).param).toBe('dimensions');
  });
});
