/** The Responses API (`/v1/responses`): request and response shapes, and `outputText`. */

export type ResponseStatus = 'in_progress' | 'completed' | 'incomplete' | 'failed' | 'cancelled' | (string & {});

/** An item of `input`: a message, a call the model made, or that call's output. */
export type ResponseInputItem =
  | { type?: 'message'; role: 'user' | 'system' | 'developer' | 'assistant'; content: string | { type: 'input_text' | 'output_text'; text: string }[] }
  | { type: 'function_call'; call_id: string; name: string; arguments: string; id?: string; status?: string }
  | { type: 'function_call_output'; call_id: string; output: string };

export interface ResponseFunctionTool {
  type: 'function';
  name: string;
  description?: string;
  parameters?: Record<string, unknown>;
  strict?: boolean;
}

export type ResponseTextFormat =
  | { type: 'text' }
  | { type: 'json_object' }
  | { type: 'json_schema'; name: string; schema: Record<string, unknown>; strict?: boolean; description?: string };

/** OpenAI's Responses fields the server implements (others it refuses with a 400), plus vLLM's sampling extras. */
export interface ResponseCreateParams {
  input: string | ResponseInputItem[];
  model?: string;
  instructions?: string;
  max_output_tokens?: number;
  temperature?: number;
  top_p?: number;
  tools?: ResponseFunctionTool[];
  tool_choice?: 'none' | 'auto' | 'required' | { type: 'function'; name: string };
  parallel_tool_calls?: boolean;
  text?: { format?: ResponseTextFormat };
  previous_response_id?: string;
  /** Keep the response for GET and previous_response_id (default true). */
  store?: boolean;
  metadata?: Record<string, string>;
  user?: string;
  seed?: number;
  top_k?: number;
  ignore_eos?: boolean;
  /** Survive a dropped connection: the Stream resumes it (with `stream: true`; docs/resume.md). */
  resumable?: boolean;
  [extra: string]: unknown;
}

export interface ResponseOutputItem {
  type: 'message' | 'function_call' | 'reasoning' | (string & {});
  id: string;
  status?: string;
  role?: 'assistant';
  /** message: `output_text` parts; reasoning: `reasoning_text` parts. */
  content?: { type: string; text: string }[];
  call_id?: string;
  name?: string;
  arguments?: string;
}

export interface ResponseUsage {
  input_tokens: number;
  input_tokens_details: { cached_tokens: number };
  output_tokens: number;
  output_tokens_details: { reasoning_tokens: number };
  total_tokens: number;
}

export interface ResponseObject {
  id: string;
  object: 'response';
  created_at: number;
  model: string;
  status: ResponseStatus;
  output: ResponseOutputItem[];
  usage: ResponseUsage | null;
  error: { code: string; message: string } | null;
  incomplete_details: { reason: string } | null;
  previous_response_id: string | null;
}

/** One streamed event; `type` says which of the optional fields it carries. */
export interface ResponseStreamEvent {
  type: string;
  sequence_number: number;
  response?: ResponseObject;
  item?: ResponseOutputItem;
  output_index?: number;
  item_id?: string;
  content_index?: number;
  delta?: string;
  text?: string;
  arguments?: string;
}

/** The text of every message item, joined (as openai's `output_text`). */
export function outputText(response: ResponseObject): string {
  return response.output
    .filter((item) => item.type === 'message')
    .flatMap((item) => item.content ?? [])
    .filter((part) => part.type === 'output_text')
    .map((part) => part.text)
    .join('');
}
