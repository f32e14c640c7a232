"""vLLM's fields that change generation: each one implemented (its effect on the prompt the
engine gets, against the `tokenizers` library's own encoding) or refused with a 400 naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import tokenizers
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REFUSED = [
    ("logits_processors", ["my.module:Processor"]),
    ("vllm_xargs", {"a": 1}),
    ("mm_processor_kwargs", {"num_crops": 4}),
    ("guided_json", {}),  # an empty schema asks for JSON: a request, not a default
    ("guided_regex", ""),
    ("guided_choice", []),
    ("guided_grammar", ""),
]
DOC_TEMPLATE = ("{% for d in documents %}<{{ d.title }}>{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
EFFORT_TEMPLATE = "effort={{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
# field -> (request extra, the text the prompt must be)
IMPLEMENTED = {
    "chat_template": ({"chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
                      "[hi]"),
    "documents": ({"chat_template": DOC_TEMPLATE, "documents": [{"title": "A", "text": "x"}]},
                  "<A>hi"),
    "reasoning_effort": ({"chat_template": EFFORT_TEMPLATE, "reasoning_effort": "low"},
                         "effort=low|hi"),
}


async def _post(engine: FakeEngine, body: dict, **settings) -> httpx.Response:
    app = build_app(engine, GatewaySettings(**settings))  # type: ignore[arg-type]
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        return await http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("name, value", REFUSED, ids=[r[0] for r in REFUSED])
async def test_refused_fields_name_themselves(fake_engine: FakeEngine, name: str,
                                              value: object) -> None:
    response = await _post(fake_engine, {**CHAT, name: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and f"`{name}`" in error["message"]
    assert not fake_engine.submitted


@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
async def test_implemented_fields_reach_the_prompt(fake_engine: FakeEngine, tokenizer_dir: Path,
                                                   name: str) -> None:
    extra, text = IMPLEMENTED[name]
    response = await _post(fake_engine, {**CHAT, **extra})
    assert response.status_code == 200, response.text
    reference = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert fake_engine.submitted[-1].prompt_token_ids == reference.encode(
        text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["documents", "reasoning_effort"])
async def test_a_template_that_does_not_read_the_field_refuses_it(
        fake_engine: FakeEngine, name: str) -> None:
    value = IMPLEMENTED[name][0][name]
    response = await _post(fake_engine, {**CHAT, name: value})  # the model's own template
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == name


async def test_a_bad_request_template_is_a_400(fake_engine: FakeEngine) -> None:
    response = await _post(fake_engine, {**CHAT, "chat_template": "{% for %}"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template"


@pytest.mark.parametrize("split", [False, True])
async def test_add_special_tokens(tokenizer_dir: Path, tmp_path: Path, split: bool) -> None:
    # a tokenizer that adds a BOS (id 0) around each text, as Llama's do
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = tok.id_to_token(0)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    engine = FakeEngine(tmp_path)
    template = {"chat_template": "{% for m in messages %}<{{ m.content }}>{% endfor %}"}
    for add in (False, True):
        body = {**CHAT, **template, "add_special_tokens": add}
        response = await _post(engine, body, split_special_tokens=split)
        assert response.status_code == 200, response.text
        want = tok.encode("<hi>", add_special_tokens=add).ids
        assert engine.submitted[-1].prompt_token_ids == want
    assert want[0] == 0 and json.dumps(want) != json.dumps(want[1:])
