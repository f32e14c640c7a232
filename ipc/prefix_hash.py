"""Chained block hashes of the prefix cache, shared by the engine (cache keys) and the gateway
(prefix-aware routing); stdlib only so that both processes compute the same bytes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable

BlockHash = bytes
DIGEST_BYTES = 8  # how much of each hash an engine reports to the gateway


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Chained hash of one full block: (parent hash, its token ids, extra keys such as a salt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def salt_bytes(cache_salt: str | None, adapter: str | None = None) -> bytes:
    """The extra key a request adds to each of its block hashes: its cache_salt, and its LoRA
    adapter (named with its load id, so that an adapter unloaded and loaded again under its
    name never meets the old one's KV): the same prompt under two adapters shares no block."""
    salt = (cache_salt or "").encode()
    return salt if adapter is None else salt + f"\x00lora:{adapter}".encode()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int,
                        extra: bytes = b"") -> list[BlockHash]:
    """Append to `hashes` (the chain of the first len(hashes) full blocks of token_ids) the
    hashes of the full blocks after them; returns `hashes`."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


def prompt_block_hashes(token_ids: list[int], block_size: int,
                        cache_salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of a prompt, as the engine's prefix cache keys them."""
    return extend_block_hashes([], token_ids, block_size, salt_bytes(cache_salt))


def pack_digest(hashes: Iterable[BlockHash]) -> bytes:
    """The report an engine sends: the first DIGEST_BYTES of each cached block hash, concatenated.

    # NOTE: 8 bytes keep 10k cached blocks at 80 kB per report; a false match (1 in 2**64 per
    # pair) would only route a request to a worse engine, never change its output.
    """
    return b"".join(h[:DIGEST_BYTES] for h in hashes)


def unpack_digest(digest: bytes) -> set[bytes]:
    n = DIGEST_BYTES
    return {digest[i : i + n] for i in range(0, len(digest) - len(digest) % n, n)}
