"""A `previous_response_id` chain against the scripted engine, read by the official `openai`
SDK: each response's prompt is HF's chat template over the earlier turns (inputs and outputs)
and this turn, with this response's `instructions` only, which OpenAI never carries along."""

from __future__ import annotations

from pathlib import Path

import openai
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def test_instructions_apply_to_their_own_response_only(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    engine = FakeEngine(tokenizer_dir, interval=0.0, max_model_len=1024)
    async with serve(build_app(engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        first = await client.responses.create(model="test-model", instructions="Be brief.",
                                              input="Hello")
        second = await client.responses.create(model="test-model", input="And then?",
                                               previous_response_id=first.id)
        third = await client.responses.create(model="test-model", instructions="Use French.",
                                              input="Why?", previous_response_id=second.id)
    assert third.instructions == "Use French." and second.instructions is None
    turns = [_user("Hello"), {"role": "assistant", "content": first.output_text},
             _user("And then?"), {"role": "assistant", "content": second.output_text},
             _user("Why?")]
    expected = [[{"role": "system", "content": "Be brief."}, *turns[:1]],
                turns[:3],
                [{"role": "system", "content": "Use French."}, *turns]]
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [hf.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
               for m in expected]
    assert [m.prompt_token_ids for m in engine.submitted] == prompts
