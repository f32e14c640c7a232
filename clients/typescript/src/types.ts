/** Request and response shapes. Enums are open: a value a newer server sends still type-checks. */

// NOTE: `(string & {})` keeps editor completion for the known values while accepting any string.
export type FinishReason = 'stop' | 'length' | 'abort' | 'error' | 'tool_calls' | (string & {});
export type GenerationStatus = 'completed' | 'cancelled' | (string & {});

export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

/** A streamed call: the first delta of each index carries id, type and name. */
export interface ToolCallDelta {
  index: number;
  id?: string;
  type?: 'function';
  function: { name?: string; arguments?: string };
}

export interface ChatMessageParam {
  role: 'system' | 'developer' | 'user' | 'assistant' | 'tool' | (string & {});
  content: string | null;
  name?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

export interface Tool {
  type: 'function';
  /** `strict`: with tool_choice 'auto', a call to this tool follows `parameters` (a grammar) once the model starts it; required and named calls always do. */
  function: { name: string; description?: string; parameters?: Record<string, unknown>; strict?: boolean };
}

export type ToolChoice = 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } };

export type ResponseFormat =
  | { type: 'text' }
  | { type: 'json_object' }
  | { type: 'json_schema'; json_schema: { name: string; schema?: Record<string, unknown>; strict?: boolean; description?: string } };

/** vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar. */
export interface StructuredOutputs {
  json?: Record<string, unknown> | string;
  json_object?: boolean;
  regex?: string;
  choice?: string[];
  grammar?: string;
  whitespace_pattern?: string;
}

/** Fields both request kinds share (OpenAI's and vLLM's); unknown extras pass through. */
export interface CommonParams {
  model?: string;
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  top_k?: number;
  min_p?: number;
  seed?: number;
  stop?: string | string[];
  presence_penalty?: number;
  frequency_penalty?: number;
  repetition_penalty?: number;
  ignore_eos?: boolean;
  /** Choices per prompt (indexed 0 .. n-1; usage sums them). */
  n?: number;
  /** Token id (as a string) -> bias in [-100, 100], added to its logit. */
  logit_bias?: Record<string, number>;
  echo?: boolean;
  use_beam_search?: boolean;
  length_penalty?: number;
  stream_options?: { include_usage?: boolean };
  /** pagedserve: the stream survives a dropped connection (docs/resume.md). */
  resumable?: boolean;
  response_format?: ResponseFormat;
  structured_outputs?: StructuredOutputs;
  [extra: string]: unknown;
}

export interface ChatCompletionParams extends CommonParams {
  messages: ChatMessageParam[];
  max_completion_tokens?: number;
  logprobs?: boolean;
  top_logprobs?: number;
  add_generation_prompt?: boolean;
  continue_final_message?: boolean;
  chat_template_kwargs?: Record<string, unknown>;
  tools?: Tool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
}

export interface CompletionParams extends CommonParams {
  /** A text, texts, token ids or token-id lists (choice j of prompt p has index p * n + j). */
  prompt: string | string[] | number[] | number[][];
  logprobs?: number;
  best_of?: number;
  prompt_logprobs?: number;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion' | (string & {});
  created: number;
  model: string;
  choices: { index: number; message: { role: string; content: string | null; tool_calls?: ToolCall[] }; finish_reason: FinishReason | null; logprobs?: unknown }[];
  usage?: Usage | null;
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk' | (string & {});
  created: number;
  model: string;
  choices: { index: number; delta: { role?: string; content?: string | null; tool_calls?: ToolCallDelta[] }; finish_reason: FinishReason | null; logprobs?: unknown }[];
  usage?: Usage | null;
}

/** A completions response, and also each chunk of a streamed one. */
export interface Completion {
  id: string;
  object: 'text_completion' | (string & {});
  created: number;
  model: string;
  choices: {
    index: number; text: string; finish_reason: FinishReason | null; logprobs?: unknown;
    /** vLLM's prompt_logprobs: per prompt token {token id: entry}; null for the first. */
    prompt_logprobs?: (Record<string, { logprob: number; rank: number | null; decoded_token: string }> | null)[];
  }[];
  usage?: Usage | null;
}

export interface Model {
  id: string;
  object: 'model' | (string & {});
  created: number;
  owned_by: string;
  max_model_len?: number | null;
  /** A LoRA adapter's base model (its requests run there). */
  parent?: string | null;
}

/** One model of `GET /models`: its state, engine processes and their resident memory. */
export interface ModelState {
  id: string;
  status: { value: 'loaded' | 'loading' | 'unloading' | 'unloaded' | (string & {}) };
  pids: number[];
  resident_bytes: number;
  data_parallel_size?: number | null;
}

/** `POST /models/load` options beside the name: `path` and engine options by their flag names
 * with underscores. */
export interface ModelLoadParams {
  path?: string;
  data_parallel_size?: number;
  [engineOption: string]: unknown;
}

/** The answer of `POST /models/load` and `/models/unload`. */
export interface ModelLoaded {
  success: boolean;
  model: string;
  pids: number[];
}

/** `POST /tokenize`'s answer (vLLM's shape). */
export interface Tokenized {
  count: number;
  max_model_len: number;
  tokens: number[];
  token_strs?: string[] | null;
}

export interface ModelList {
  object: 'list' | (string & {});
  data: Model[];
}

/** The `generation.done` frame of a WebSocket generation. */
export interface GenerationDone {
  id: string;
  status: GenerationStatus;
  finish_reason: FinishReason | null;
  /** One per choice (n > 1), in index order. */
  finish_reasons?: (FinishReason | null)[];
  usage?: Usage | null;
}

export interface RequestOptions {
  /** Aborting it cancels the request (and the generation on the server). */
  signal?: AbortSignal;
  /** Extra request headers. */
  headers?: Record<string, string>;
}

/** The text a chunk adds (empty for role-only and usage chunks). */
export function chunkText(chunk: ChatCompletionChunk | Completion): string {
  return chunk.choices
    .map((c) => ('delta' in c ? c.delta.content ?? '' : (c as { text?: string }).text ?? ''))
    .join('');
}
