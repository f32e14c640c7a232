"""The tokenizer as llguidance sees it: the exact bytes of every token id.

Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) spells bytes as printable code points; SentencePiece
BPE (Llama 2, Mistral) writes a space as U+2581 and raw bytes as `<0xNN>`. Added tokens are literal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import llguidance
import tokenizers

_SPACE_PIECE = "\u2581"


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable code point -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _is_byte_level(spec: dict) -> bool:
    def has(node: dict | None) -> bool:
        if not node:
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(n) for n in node.get("decoders", node.get("pretokenizers", [])) or [])
    return has(spec.get("decoder")) or has(spec.get("pre_tokenizer"))


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level:
        table = _byte_level_decoder()
        return bytes(table[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
    return piece.replace(_SPACE_PIECE, " ").encode("utf-8")


def token_bytes(tok: tokenizers.Tokenizer, spec: dict, vocab_size: int) -> list[bytes]:
    """bytes of each id below vocab_size (ids the tokenizer lacks, model padding, are empty)."""
    byte_level = _is_byte_level(spec)
    added = tok.get_added_tokens_decoder()
    out: list[bytes] = []
    for i in range(vocab_size):
        if i in added:
            out.append(added[i].content.encode("utf-8"))
            continue
        piece = tok.id_to_token(i)
        out.append(b"" if piece is None else _piece_bytes(piece, byte_level))
    return out


class _Wrapper:
    """What llguidance.TokenizerWrapper reads: ids' bytes, special ids, and an encoder."""

    def __init__(self, tok: tokenizers.Tokenizer, tokens: list[bytes], eos: int,
                 bos: int | None, special: list[int]) -> None:
        self._tok = tok
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = special

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False).ids


def build_lltokenizer(directory: str | Path, vocab_size: int,
                      eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """An LLTokenizer over the model's vocabulary (vocab_size: the logits' width)."""
    path = Path(directory) / "tokenizer.json"
    tok = tokenizers.Tokenizer.from_file(str(path))
    spec = json.loads(path.read_text())
    tokens = token_bytes(tok, spec, vocab_size)
    special = [i for i, t in tok.get_added_tokens_decoder().items()
               if t.special and i < vocab_size]
    eos = list(eos_token_ids) or [0]
    bos = tok.token_to_id("<s>")
    wrapper = _Wrapper(tok, tokens, eos[0], bos, special)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size,
                                  eos_token=eos)
