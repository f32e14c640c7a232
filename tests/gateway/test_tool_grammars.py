"""Tool-call grammars fed token by token to llguidance's matcher on the bundled vocabulary: a
random walk over the allowed tokens is the random model's worst case (it never writes the
structure itself), so the call's opening is teacher-forced and every token after it is drawn
uniformly from the mask. What comes out must parse with the format's parser and validate with
`jsonschema`; Llama 3 calls also with Meta's own parser (llama_models)."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import msgspec
import numpy as np
import pytest
from llama_models.llama3.tool_utils import ToolUtils
from llguidance.numpy import fill_next_token_bitmask

from engine.sched.structured.tokenizer import build_lltokenizer
from gateway.requests import ChatCompletionRequest, Tool
from gateway.structured import auto_tool_grammar, structured_for, tool_call_grammar
from gateway.tools.registry import FORMATS, CallSyntax
from gateway.validate import decode_request

VOCAB, EOS = 49152, 2  # the bundled SmolLM2: <|im_end|> ends a turn
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "strict": True, "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "maxLength": 10}}, "required": ["tz"],
        "additionalProperties": False}}}
LOOSE = {"type": "function", "function": {  # not strict: in auto, its arguments are any object
    "name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]}}}
OPENING = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]"}


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir) -> llguidance.LLTokenizer:
    return build_lltokenizer(bundled_tokenizer_dir, VOCAB, [EOS])


def _tools(*tools: dict) -> list[Tool]:
    return [msgspec.convert(t, type=Tool) for t in tools]


def _matcher(tok, grammar: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _accepts(tok, grammar: str, text: str) -> bool:
    """The grammar takes all of `text` and may end right after it."""
    m = _matcher(tok, grammar)
    ids = tok.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def _walk(tok, grammar: str, forced: str, seed: int, limit: int = 400) -> str:
    """`forced` teacher-forced, then tokens drawn uniformly from the mask until the grammar
    allows EOS (the call is complete); the text written."""
    m, rng = _matcher(tok, grammar), np.random.default_rng(seed)
    ids = tok.tokenize_str(forced)
    assert m.consume_tokens(ids), m.get_error()
    mask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    for _ in range(limit):
        fill_next_token_bitmask(m, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB])
        if EOS in allowed:
            return tok.decode_str(ids)
        token = int(rng.choice(allowed))
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    raise AssertionError(f"no end within {limit} tokens: {tok.decode_str(ids)!r}")


def _parsed(parser: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    p = FORMATS[parser].parser()
    events = p.feed(text, final=True)
    content = "".join(e.content for e in events if e.index is None)
    return content, [(name, json.loads(args)) for _, name, args in p.calls]


def _check(calls: list[tuple[str, dict]]) -> None:
    assert calls
    for name, args in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[name]
        jsonschema.validate(args, tool["function"]["parameters"])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_auto_strict_calls_are_constrained_once_opened(tok, parser):
    syntax = CallSyntax(parser)
    grammar = auto_tool_grammar(_tools(WEATHER, TIME), False, syntax)
    prefix = "" if parser == "llama3_json" else "Let me look. "
    for seed in range(8):
        text = _walk(tok, grammar, prefix + OPENING[parser], seed)
        content, calls = _parsed(parser, text)
        # NOTE: the last token may close the call and begin text (`>)`): content after it
        assert content.startswith(prefix.strip()) and len(calls) == 1
        _check(calls)
        if parser == "llama3_json":  # Meta's parser reads the same call
            name, args = ToolUtils.maybe_extract_custom_tool_call(text)
            assert [(name, args)] == calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_auto_strict_allows_text_and_refuses_broken_calls(tok, parser):
    grammar = auto_tool_grammar(_tools(WEATHER), True, CallSyntax(parser))
    good = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": %s}',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": %s}]'}[parser]
    args = '{"city": "Oslo", "unit": "celsius", "days": 2}'
    assert _accepts(tok, grammar, "Plain text, <tool_box> or [TOOLS] included.")
    assert _accepts(tok, grammar, "")
    if parser != "llama3_json":
        assert _accepts(tok, grammar, "Sure. " + good % args)
    assert _accepts(tok, grammar, good % args)
    assert not _accepts(tok, grammar, good % '{"city": "Oslo"}')  # a required field missing
    assert not _accepts(tok, grammar, good % args.replace("celsius", "kelvin"))
    assert not _accepts(tok, grammar, (good % args).replace("get_weather", "get_wether"))
    loose = auto_tool_grammar(_tools(WEATHER, LOOSE), True, CallSyntax(parser))
    assert _accepts(tok, loose, good.replace("get_weather", "note") % '{"any": [1]}')
    assert not _accepts(tok, loose, good.replace("get_weather", "note") % '[1]')
    cut = (good % args)[:-3]
    m = _matcher(tok, grammar)
    assert m.try_consume_tokens(tok.tokenize_str(cut)) > 0 and not m.is_accepting()


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_grammar_writes_the_parsers_format(tok, parser):
    grammar = tool_call_grammar(_tools(WEATHER, TIME), True, CallSyntax(parser))
    for seed in range(6):
        text = _walk(tok, grammar, "", seed)
        content, calls = _parsed(parser, text)
        assert content == "" and calls  # one call, or more (a Mistral list ends at `]`)
        _check(calls)
    assert not _accepts(tok, grammar, "no call")


def test_two_calls_each_constrained(tok):
    grammar = auto_tool_grammar(_tools(WEATHER, TIME), True, CallSyntax("hermes"))
    first = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    text = _walk(tok, grammar, f"Two calls. {first}\n<tool_call>", seed=1)
    content, calls = _parsed("hermes", text)
    assert content.startswith("Two calls. ") and len(calls) == 2
    assert calls[0] == ("get_time", {"tz": "UTC"})
    _check(calls)


def _with_special(bundled_tokenizer_dir, path, *texts: str) -> llguidance.LLTokenizer:
    """The bundled tokenizer with `texts` added as special tokens (ids VOCAB, VOCAB + 1...)."""
    spec = json.loads((bundled_tokenizer_dir / "tokenizer.json").read_text())
    for i, text in enumerate(texts):
        spec["added_tokens"].append({"id": VOCAB + i, "content": text, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return build_lltokenizer(path, VOCAB + len(texts), [EOS])


def test_special_token_tags_of_hermes(bundled_tokenizer_dir, tmp_path):
    tok = _with_special(bundled_tokenizer_dir, tmp_path, "<tool_call>", "</tool_call>")
    syntax = CallSyntax("hermes", f"<[{VOCAB}]>", f"<[{VOCAB + 1}]>")
    body = tok.tokenize_str('\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n')
    for grammar in (tool_call_grammar(_tools(TIME), True, syntax),
                    auto_tool_grammar(_tools(TIME), True, syntax)):
        m = _matcher(tok, grammar)
        assert m.consume_tokens([VOCAB, *body, VOCAB + 1]) and m.is_accepting()
        m = _matcher(tok, grammar)  # the closing tag as plain text does not close the call
        ids = [VOCAB, *body, *tok.tokenize_str("</") + tok.tokenize_str("tool_call>")]
        assert m.try_consume_tokens(ids) < len(ids)


def test_a_special_token_opening(bundled_tokenizer_dir, tmp_path):
    """Mistral's [TOOL_CALLS] is one special token: the grammar names it by id (`<[id]>`), and
    its text (kept, as special tokens are for this parser) opens the call."""
    tok = _with_special(bundled_tokenizer_dir, tmp_path, "[TOOL_CALLS]")
    grammar = auto_tool_grammar(_tools(WEATHER), False, CallSyntax("mistral", f"<[{VOCAB}]>"))
    m = _matcher(tok, grammar)
    assert m.consume_tokens(tok.tokenize_str("Hi ")) and m.consume_token(VOCAB)
    plain = _matcher(tok, grammar)  # the same text in plain tokens is only text
    ids = tok.tokenize_str("Hi [TOOL") + tok.tokenize_str("_CALLS] hello")
    assert VOCAB not in ids and plain.try_consume_tokens(ids) == len(ids)
    assert plain.is_accepting()
    mask = np.zeros((1, (VOCAB + 32) // 32), dtype=np.int32)
    fill_next_token_bitmask(m, mask, 0)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB + 1])
    assert EOS not in allowed and len(allowed)  # only " [" and what may follow it
    assert all(tok.decode_str([int(t)]).startswith(" [") for t in allowed)


def _request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def test_which_auto_requests_get_a_grammar():
    assert structured_for(_request(tools=[LOOSE])) is None  # not strict: parsed only
    assert structured_for(_request(tools=[LOOSE], tool_choice="auto")) is None
    strict = structured_for(_request(tools=[WEATHER, LOOSE]), CallSyntax("mistral"))
    assert strict.param == "tools" and "[TOOL_CALLS]" in strict.grammar
    assert "lazy" in strict.grammar
    assert structured_for(_request(tools=[WEATHER], tool_choice="none")) is None


def test_rollback_inside_a_started_call(tok):
    """Speculative decoding rolls the matcher back: a lazy grammar (no max_tokens) allows it,
    and the state after re-consuming equals the state before."""
    grammar = auto_tool_grammar(_tools(WEATHER), True, CallSyntax("hermes"))
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "'
    ids = tok.tokenize_str(text)
    m = _matcher(tok, grammar)
    assert m.consume_tokens(ids)
    before = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    fill_next_token_bitmask(m, before, 0)
    assert m.rollback(8) and m.consume_tokens(ids[-8:])
    after = np.zeros_like(before)
    fill_next_token_bitmask(m, after, 0)
    assert (before == after).all() and not m.is_error()
