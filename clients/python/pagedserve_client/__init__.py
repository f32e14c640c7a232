"""pagedserve's Python SDK: `Client`/`AsyncClient` (HTTP + SSE) and `WebSocketClient`."""

from pagedserve_client._client import AsyncClient, Client
from pagedserve_client._embeddings import (
    CreateEmbeddingResponse,
    Embedding,
    RerankResponse,
    RerankResult,
    Score,
    ScoreResponse,
)
from pagedserve_client._errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PagedServeError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
    StreamError,
    UnprocessableEntityError,
)
from pagedserve_client._responses import Response, ResponseStreamEvent
from pagedserve_client._sse import ServerSentEvent, SSEDecoder
from pagedserve_client._streaming import AsyncStream, Stream
from pagedserve_client._types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    FinishReason,
    GenerationDone,
    GenerationStatus,
    Model,
    ModelList,
    ModelLoaded,
    ModelState,
    PromptLogprob,
    Tokenized,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from pagedserve_client._ws import Generation, WebSocketClient

__all__ = [
    "APIConnectionError", "APIError", "APIStatusError", "APITimeoutError", "AsyncClient",
    "AsyncStream", "AuthenticationError", "BadRequestError", "ChatCompletion",
    "ChatCompletionChunk", "Client", "Completion", "ConflictError", "CreateEmbeddingResponse",
    "Embedding", "RerankResponse", "RerankResult", "Score", "ScoreResponse", "FinishReason",
    "Generation",
    "GenerationDone", "GenerationStatus", "InternalServerError", "Model", "ModelList",
    "ModelLoaded", "ModelState", "NotFoundError", "PagedServeError", "PermissionDeniedError",
    "PromptLogprob", "RateLimitError",
    "RequestTooLargeError", "Response", "ResponseStreamEvent", "SSEDecoder", "ServerSentEvent",
    "ServiceUnavailableError", "Stream",
    "StreamError", "Tokenized", "ToolCall", "ToolCallDelta", "UnprocessableEntityError", "Usage",
    "WebSocketClient",
]
