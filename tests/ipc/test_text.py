"""IncrementalDetokenizer and StopMatcher against the bundled model's real tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc.text import IncrementalDetokenizer, StopMatcher

TEXTS = [
    "Hello, world! How are you today?",
    "héllo wörld — naïve café",
    "中文字符测试，日本語のテキスト",
    "emoji 🎉🚀 and a family 👨‍👩‍👧 done",
    "  leading spaces\tand\nnewlines\n\n",
    "mixed: 한국어 العربية עברית ✓ ∑ 𝔘𝔫𝔦",
]

@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir: Path) -> tokenizers.Tokenizer:
    """The bundled model's tokenizer ($PAGEDSERVE_TEST_TOKENIZER reuses one)."""
    given = os.environ.get("PAGEDSERVE_TEST_TOKENIZER")
    path = Path(given) if given and (Path(given) / "tokenizer.json").is_file() else (
        bundled_tokenizer_dir)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def _stream(tok: tokenizers.Tokenizer, chunks: list[list[int]], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.add(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok: tokenizers.Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False).ids
    deltas = _stream(tok, [[i] for i in ids])
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_point(tok: tokenizers.Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False).ids
    for cut in range(len(ids) + 1):
        deltas = _stream(tok, [ids[:cut], ids[cut:]])
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_char_is_held_until_complete(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode(" 🎉", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's bytes span several tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == " 🎉"


def test_special_tokens(tok: tokenizers.Tokenizer) -> None:
    ids = [1] + tok.encode("hi there", add_special_tokens=False).ids + [2]
    assert "".join(_stream(tok, [[i] for i in ids])) == "hi there"
    kept = "".join(_stream(tok, [[i] for i in ids], skip=False))
    assert kept == tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi there<|im_end|>"


def test_incomplete_tail_is_released_by_flush(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode("ok 🎉", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    shown = "".join(detok.add([i]) for i in ids[:-1])
    assert shown == "ok"
    assert shown + detok.flush() == tok.decode(ids[:-1])
    assert detok.flush() == ""


def test_empty_input(tok: tokenizers.Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.add([]) == "" and detok.flush() == "" and detok.text == ""


# ---- StopMatcher -------------------------------------------------------------------------


def _run(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def _splits(text: str) -> list[list[str]]:
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    return cuts + [list(text)]


@pytest.mark.parametrize("pieces", _splits("The answer is 42.\nUser: more"))
def test_stop_split_anywhere(pieces: list[str]) -> None:
    assert _run(StopMatcher(["\nUser:"]), pieces) == ("The answer is 42.", True)
    assert _run(StopMatcher(["\nUser:"], include_stop=True), pieces) == (
        "The answer is 42.\nUser:",
        True,
    )


@pytest.mark.parametrize("pieces", _splits("a 🎉 b 世界 c"))
def test_multibyte_stop(pieces: list[str]) -> None:
    assert _run(StopMatcher(["世界"]), pieces) == ("a 🎉 b ", True)


@pytest.mark.parametrize("pieces", _splits("abcab abd"))
def test_partial_match_is_released(pieces: list[str]) -> None:
    assert _run(StopMatcher(["abd!"]), pieces) == ("abcab abd", False)


def test_held_text_never_leaks_and_earliest_stop_wins() -> None:
    matcher = StopMatcher(["STOP", "OP"])
    assert matcher.push("xx ST") == ("xx ", False)
    assert matcher.push("OP yy") == ("", True)
    assert matcher.matched == "STOP"
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stops_passes_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


class _CharTokenizer:
    """Token id i is chr(i): an independent, exact decoder for these tests."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_choice_text_drops_the_stop_tokens_text_unless_asked() -> None:
    from ipc.text import ChoiceText

    ids = [ord(c) for c in "ab!"]
    assert ChoiceText(_CharTokenizer()).add(ids, True, True) == ("ab", False)
    assert ChoiceText(_CharTokenizer(), include_stop_str_in_output=True).add(
        ids, True, True) == ("ab!", False)
    assert ChoiceText(_CharTokenizer()).add(ids, True, False) == ("ab!", False)
    text = ChoiceText(_CharTokenizer(), stop=["b!"])
    assert text.add(ids[:2]) == ("a", False)  # "b" may start the stop string: held back
    assert text.add(ids[2:]) == ("", True) and text.matched == "b!"
# ---- StopMatcher against a naive reference -------------------------------------------------


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, bool, str | None]:
    """Scan every end position: the first stop completed wins; at one end, the longest."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.endswith(s, 0, end)]
        if done:
            stop = max(done, key=len)
            return text[: end if include else end - len(stop)], True, stop
    return text, False, None


def _held_reference(seen: str, stops: list[str]) -> int:
    """Length of the longest suffix of `seen` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if seen.endswith(s[:n])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    include=st.booleans(),
)
def test_stop_matcher_matches_a_naive_reference(text: str, stops: list[str], cuts: list[int],
                                                include: bool) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopMatcher(stops, include)
    out, seen, stopped = "", "", False
    for piece in pieces:
        shown, stopped = matcher.push(piece)
        out, seen = out + shown, seen + piece
        if stopped:
            break
        # NOTE: exactly what may still start a stop string is held back, nothing more
        assert out == seen[: len(seen) - _held_reference(seen, stops)]
    if not stopped:
        out += matcher.flush()
    want, want_stopped, want_stop = _reference(text, stops, include)
    assert (out, stopped, matcher.matched) == (want, want_stopped, want_stop)


def test_a_long_stop_string_is_held_back_until_it_completes() -> None:
    stops = [f"stop{i:04d}" for i in range(16)] + ["x" * 256]
    matcher = StopMatcher(stops)
    shown = "".join(matcher.push(c)[0] for c in "y" * 1000 + "x" * 255)
    assert shown == "y" * 1000 and matcher.push("x") == ("", True) and matcher.matched == stops[-1]
