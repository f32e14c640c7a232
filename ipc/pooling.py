"""Pooling (embedding) requests on the wire: what a request asks (PoolingParams) and what the
engine's model pools by default (PoolingInfo, in its handshake)."""

from __future__ import annotations

import msgspec

from ipc.config import POOLING_METHODS


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A prefill-only request: its prompt's hidden states pooled into one vector (no tokens).

    method/normalize None: the model's (PoolingInfo). dimensions: keep the first this many
    values (Matryoshka truncation, before normalization), where the model allows it."""

    method: str | None = None  # last | mean | cls
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {POOLING_METHODS}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be >= 1")


class PoolingInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the engine's model pools: from the checkpoint's sentence-transformers config
    (modules.json, 1_Pooling/config.json, a Normalize module) when present, else the
    decoder default (last token, normalized), with --pooling over either."""

    dimensions: int  # the pooled vector's length (hidden size)
    method: str = "last"
    normalize: bool = True
    # Matryoshka: the lengths the model was trained to be truncated to (config.json's
    # `matryoshka_dimensions`), or every length (`is_matryoshka`: true, and no list)
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_matryoshka: bool = False
    source: str = "default"  # sentence-transformers | default | --pooling | classifier
    # a cross-encoder (a *ForSequenceClassification checkpoint): its score head's labels (1:
    # a pooled vector is [sigmoid(score)] of a query/document pair); None: an embedding model
    num_labels: int | None = None

    def allows(self, dimensions: int) -> bool:
        """Whether a vector truncated to `dimensions` is one the model was trained for."""
        if dimensions == self.dimensions:
            return True
        if not self.is_matryoshka or dimensions > self.dimensions:
            return False
        return self.matryoshka_dimensions is None or dimensions in self.matryoshka_dimensions
