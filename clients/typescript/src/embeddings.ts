/** Embeddings, rerank and score: request and response types, and the base64 decoding of an
 * embedding (little-endian float32, as OpenAI's SDKs read it). */

export interface EmbeddingCreateParams {
  /** A text, texts, token ids or token-id lists. */
  input: string | string[] | number[] | number[][];
  model?: string;
  /** `base64` is decoded to numbers by `embeddings.create`. */
  encoding_format?: 'float' | 'base64';
  /** Matryoshka truncation, where the model allows it. */
  dimensions?: number;
  user?: string;
  normalize?: boolean;
  [extra: string]: unknown;
}

export interface Embedding { index: number; embedding: number[]; object: 'embedding' }

export interface EmbeddingUsage { prompt_tokens: number; total_tokens: number }

export interface CreateEmbeddingResponse {
  id: string;
  object: 'list';
  data: Embedding[];
  model: string;
  usage: EmbeddingUsage;
}

export interface RerankParams {
  query: string;
  documents: (string | { text: string })[];
  model?: string;
  /** The best this many (default: all). */
  top_n?: number;
  return_documents?: boolean;
  [extra: string]: unknown;
}

export interface RerankResult { index: number; relevance_score: number; document?: { text: string } }

export interface RerankResponse { id: string; model: string; results: RerankResult[]; usage: EmbeddingUsage }

export interface ScoreParams {
  /** One text against each text_2 (1 -> N), or pairwise (N <-> N). */
  text_1: string | string[];
  text_2: string | string[];
  model?: string;
}

export interface ScoreResponse {
  id: string;
  object: 'list';
  model: string;
  data: { index: number; score: number; object: 'score' }[];
  usage: EmbeddingUsage;
}

/** The floats of a base64 embedding (little-endian float32). */
export function decodeBase64Embedding(text: string): number[] {
  const binary = atob(text);
  const view = new DataView(new ArrayBuffer(binary.length));
  for (let i = 0; i < binary.length; i++) view.setUint8(i, binary.charCodeAt(i));
  const out: number[] = [];
  for (let i = 0; i + 4 <= binary.length; i += 4) out.push(view.getFloat32(i, true));
  return out;
}

/** The response with every base64 embedding decoded. */
export function decodeEmbeddings(body: { data: { embedding: number[] | string }[] }): CreateEmbeddingResponse {
  for (const item of body.data) {
    if (typeof item.embedding === 'string') item.embedding = decodeBase64Embedding(item.embedding);
  }
  return body as CreateEmbeddingResponse;
}
