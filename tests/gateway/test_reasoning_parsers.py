"""The reasoning parsers split a reply as an independent split of the whole text does: fed in
one piece, and cut at every position into two and three pieces."""

from __future__ import annotations

import itertools

import pytest

from gateway.reasoning import REASONING_PARSERS
from gateway.reasoning.think import ThinkParser

TEXTS = [
    "<think>\nLet me see: 2 < 3 and </thi is not it.\n</think>\n\nThe answer is 4.",
    "<think></think>answer",
    "<think>only reasoning, cut short <",
    "plain answer, no thinking < > </",
    "  <think>x</think>",
    "reasoning without an opening</think>then the answer </think> stays",
    "</think>",
    "<",
    "",
    "[THINK]mistral thinks[/THINK]and answers",
    "before [THINK]inside[/THINK] after [THINK] not again",
]


def reference(name: str, text: str, prompt_tail: str = "") -> tuple[str, str]:
    """The split by str.partition on the whole text (written apart from the parser)."""
    start, end = ("[THINK]", "[/THINK]") if name == "mistral" else ("<think>", "</think>")
    tail = prompt_tail.rstrip()
    if tail.endswith(end):
        return "", text
    if tail.endswith(start) or name in ("deepseek_r1", "deepseek_v3"):
        # reasoning from the start; a start marker before the end marker is dropped
        head, sep, rest = text.partition(end)
        head = head.replace(start, "", 1)
        return head, rest if sep else ""
    before, sep, rest = text.partition(start)
    if not sep:
        return "", text
    reasoning, _, after = rest.partition(end)
    return reasoning, before + after


def run(parser: ThinkParser, pieces: list[str]) -> tuple[str, str]:
    out_r, out_a = [], []
    for k, piece in enumerate(pieces):
        r, a = parser.feed(piece, final=k == len(pieces) - 1)
        out_r.append(r)
        out_a.append(a)
    return "".join(out_r), "".join(out_a)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("tail", ["", "<|im_start|>assistant\n", "assistant\n<think>\n",
                                  "assistant\n<think>\n\n</think>\n\n"])
def test_every_chunk_boundary(name: str, tail: str) -> None:
    cls = REASONING_PARSERS[name]
    for text in TEXTS:
        if cls.start == "[THINK]" and "<think>" in tail:
            continue  # another family's template
        want = reference(name, text, tail)
        assert run(cls(tail), [text]) == want, (name, text)
        for i in range(len(text) + 1):
            assert run(cls(tail), [text[:i], text[i:]]) == want, (name, text, i)
        for i, j in itertools.combinations(range(len(text) + 1), 2):
            assert run(cls(tail), [text[:i], text[i:j], text[j:]]) == want, (name, text, i, j)


def test_marker_held_back_until_decided() -> None:
    p = REASONING_PARSERS["qwen3"]()
    assert p.feed("<thi") == ("", "")  # may be the start marker: nothing shown yet
    assert p.feed("nk>abc</th") == ("abc", "")
    assert p.feed("ink>ok") == ("", "ok")
    assert p.reasoning_ended
    q = REASONING_PARSERS["qwen3"]()
    assert q.feed("<thu") == ("", "<thu")  # not a marker after all


def test_count_by_marker_ids() -> None:
    # ids: 7 = <think>, 8 = </think>; counted strictly between them, as vLLM counts
    p = REASONING_PARSERS["qwen3"]("", 7, 8)
    assert [p.count(ids) for ids in ([7], [1, 2], [3, 8, 4], [5])] == [0, 2, 1, 0]
    r1 = REASONING_PARSERS["deepseek_r1"]("<think>\n", 7, 8)
    assert r1.count([1, 7, 2, 8, 3, 7, 4]) == 2  # a stray <think> inside is not reasoning
    off = REASONING_PARSERS["qwen3"]("<think>\n\n</think>\n\n", 7, 8)
    assert off.count([7, 1, 8]) == 0  # the prompt ended the thinking: nothing is reasoning


def test_count_without_marker_ids_follows_the_text() -> None:
    p = REASONING_PARSERS["deepseek_r1"]()
    p.feed("abc")
    assert p.count([1, 2]) == 2
    p.feed("d</think>e")
    assert p.count([3, 4]) == 0


def test_deepseek_v3_thinks_only_when_asked() -> None:
    cls = REASONING_PARSERS["deepseek_v3"]
    assert cls.thinks({"thinking": True}) and not cls.thinks({})
    assert REASONING_PARSERS["deepseek_r1"].thinks({})
