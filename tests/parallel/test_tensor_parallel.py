"""Tensor parallel on CPU (gloo): TP=2 gives TP=1's greedy tokens and logprobs; shard plans;
a dead worker takes its engine down with an error, not a hang.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import psutil
import pytest

# NOTE: a plain import, not importorskip: `make test` installs the engine, so an ImportError
# in it must fail these tests, not skip them
import engine.core  # noqa: F401
from engine.models.config import ModelConfig
from engine.parallel.layers import shard_plan
from ipc.config import EngineConfig
from ipc.sampling import SamplingParams

pytestmark = pytest.mark.timeout(240)
PROMPTS = [[1, 5, 9, 33, 100, 7, 8], list(range(10, 60))]


def _run(model: str | None, tp: int, prompts: list[list[int]] = PROMPTS, num_gpu_blocks: int = 64,
         min_preemptions: int = 0) -> list[tuple[list[int], list[dict[int, float]]]]:
    from engine.llm import LLM

    llm = LLM(model, device="cpu", num_gpu_blocks=num_gpu_blocks, max_model_len=256,
              num_threads=1, tensor_parallel_size=tp, preemption_mode="swap")
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.stats().num_preemptions_swap >= min_preemptions
        return [(r.token_ids, r.logprobs or []) for r in out]
    finally:
        if tp > 1:
            llm.engine.runner.shutdown()


def _assert_same(tp1, tp2) -> None:
    for (ids1, lp1), (ids2, lp2) in zip(tp1, tp2, strict=True):
        assert ids1 == ids2
        for a, b in zip(lp1, lp2, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-3 for k in a)


@pytest.mark.parametrize("heads", [(4, 2), (6, 3)], ids=["divides", "uneven"])
def test_tp2_matches_tp1_on_tiny_models(tmp_path: Path, bundled_tokenizer_dir: Path,
                                        heads: tuple[int, int]) -> None:
    from tests.conftest import build_tiny_llama

    # NOTE: 6 query / 3 KV heads, MLP width 100 and vocab 49153 split unevenly over 2 ranks.
    odd = {} if heads == (4, 2) else dict(hidden_size=96, intermediate_size=100,
                                          vocab_size=49153)
    model = build_tiny_llama(tmp_path, bundled_tokenizer_dir, num_attention_heads=heads[0],
                             num_key_value_heads=heads[1], **odd)
    if heads == (4, 2):
        _assert_same(_run(str(model), 1), _run(str(model), 2))
        return
    # NOTE: 60-token prompts fill 4 blocks and grow into a 5th in an 8-block pool: preemption
    # swaps KV out and back in, so the workers must copy their blocks as the driver does.
    prompts = [[(13 * i + j) % 900 + 3 for j in range(60)] for i in range(4)]
    kw = dict(prompts=prompts, num_gpu_blocks=8, min_preemptions=1)
    _assert_same(_run(str(model), 1, **kw), _run(str(model), 2, **kw))


def test_tp2_matches_tp1_on_the_bundled_model() -> None:
    # NOTE: SmolLM2-135M has 9 query and 3 KV heads: ranks hold 2 and 1 GQA groups.
    tp1, tp2 = _run(None, 1), _run(None, 2)
    assert [ids for ids, _ in tp1] == [ids for ids, _ in tp2]


def test_shard_plans() -> None:
    def cfg(heads: int, kv: int) -> ModelConfig:
        return ModelConfig(vocab_size=10, hidden_size=8 * heads, intermediate_size=7,
                           num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=8,
                           rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                           max_position_embeddings=64, tie_word_embeddings=True,
                           eos_token_ids=(2,), bos_token_id=1)

    plans = [shard_plan(cfg(9, 3), r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads, p.intermediate, p.vocab) for p in plans] == [
        ((0, 6), (0, 2), (0, 4), (0, 5)), ((6, 9), (2, 3), (4, 7), (5, 10))]
    replicated = [shard_plan(cfg(4, 1), r, 2) for r in range(2)]  # MQA: KV head on both
    assert [(p.q_heads, p.kv_heads) for p in replicated] == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    with pytest.raises(ValueError, match="multiple"):
        shard_plan(cfg(6, 2), 0, 3)


async def test_a_dead_worker_fails_the_engine_cleanly(tiny_model_dir: Path) -> None:
    from gateway.engine_client import EngineClient
    from ipc.messages import AddRequest

    config = EngineConfig(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=64,
                          max_model_len=256, num_threads=1, tensor_parallel_size=2)
    client = EngineClient(config, heartbeat_timeout=20.0, heartbeat_interval=0.2,
                          startup_timeout=120.0, restart=False)
    await client.start()
    try:
        stream = client.submit(AddRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                          sampling=SamplingParams(max_tokens=200)))
        assert client.pid is not None
        workers = psutil.Process(client.pid).children()
        assert workers, "no tensor-parallel worker process"
        os.kill(workers[-1].pid, signal.SIGKILL)

        async def collect():
            return [d async for d in stream]

        deltas = await asyncio.wait_for(collect(), 30.0)
        assert deltas[-1].finish_reason == "error"
        for _ in range(100):
            if client._proc is not None and client._proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert client._proc is not None and client._proc.returncode is not None
        assert not client.ready and client.last_error
    finally:
        await client.close(timeout=2)


def test_two_phase_steps_choices_grammars_and_prompt_logprobs_match_tp1(
        tiny_model_dir: Path) -> None:
    """Self drafts (the propose phase runs on every rank, then verification), n=2 seeded
    sampling with copy-on-write of the shared last prompt block, a grammar's masks, prompt
    logprobs: TP=2 gives TP=1's tokens, so every rank ran the same collectives on the same
    inputs and sampled alike."""
    from engine.llm import LLM
    from ipc.sampling import StructuredOutputs

    def run(tp: int):
        llm = LLM(str(tiny_model_dir), device="cpu", num_gpu_blocks=64, max_model_len=256,
                  num_threads=1, tensor_parallel_size=tp, speculative_method="self",
                  speculative_draft_layers=1, num_speculative_tokens=3)
        try:
            params = [
                SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2),
                SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2),
                SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=(
                    StructuredOutputs(regex=r"[A-Z][a-z]{2,5}-[0-9]{2}")))]
            prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
            out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert llm.engine.stats().spec_draft_tokens > 0
            return [[c.token_ids for c in r.outputs] for r in out], out[0].prompt_logprobs
        finally:
            if tp > 1:
                llm.engine.runner.shutdown()

    (tokens1, prompt1), (tokens2, prompt2) = run(1), run(2)
    assert tokens2 == tokens1
    assert prompt1[0] is None and prompt2[0] is None
    _assert_same([([], prompt1[1:])], [([], prompt2[1:])])


def test_a_draft_model_under_tensor_parallelism_is_refused_by_the_config() -> None:
    # NOTE: at config time, before any rank is started (it used to come after every rank had
    # joined and loaded its shard, and headless nodes then died with ENGINE_DIED)
    with pytest.raises(ValueError, match="speculative_method draft does not run with tensor"):
        EngineConfig(tensor_parallel_size=2, speculative_method="draft",
                     speculative_model="/some/draft")
