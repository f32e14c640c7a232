"""Pooling (embedding) requests in EngineCore against independent references: sentence-
transformers encoding the same checkpoints (last-token, mean, CLS; with and without its
Normalize module), HF hidden states pooled in the test (--pooling, and the default of a
checkpoint without modules.json), chunked prefill, and pooling requests beside running
generations (their greedy tokens unchanged, KV balanced)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from tiny_embedder import embedder_dir

from engine.core import EngineCore
from ipc.config import EngineConfig
from ipc.messages import AddRequest
from ipc.pooling import PoolingParams
from ipc.sampling import SamplingParams

TEXTS = ["The cat sat on the mat.", "Paged attention keeps the KV cache in blocks. " * 12,
         "Embeddings map text to vectors"]
POOL = SamplingParams(max_tokens=None, pooling=PoolingParams())


def _core(model_dir, **options) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), num_gpu_blocks=64, block_size=16,
                                   **options))


def _pool(core: EngineCore, prompts: list[list[int]], params=POOL) -> tuple[list, int]:
    """Each prompt's vector, and the steps it took."""
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(request_id=f"e{i}", prompt_token_ids=ids, sampling=params))
    out, steps = {}, 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 200
        for d in core.step():
            assert d.finished and d.finish_reason == "stop" and not d.new_token_ids, d
            out[d.request_id] = torch.tensor(d.pooled)
    return [out[f"e{i}"] for i in range(len(prompts))], steps


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double(), b.double(), dim=0).item()


@pytest.mark.parametrize(("method", "normalize", "family"), [
    ("last", True, "qwen3"), ("mean", True, "qwen3"), ("cls", True, "qwen3"),
    ("mean", False, "llama")])
def test_matches_sentence_transformers(method, normalize, family):
    model_dir = embedder_dir(method, normalize, family)
    st = SentenceTransformer(str(model_dir), device="cpu")
    ref = st.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=False)
    prompts = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    core = _core(model_dir)
    assert (core.pooling_info.method, core.pooling_info.normalize) == (method, normalize)
    assert core.pooling_info.source == "sentence-transformers"
    vectors, _ = _pool(core, prompts)
    for ours, theirs in zip(vectors, ref, strict=True):
        assert _cos(ours, theirs) >= 0.9999
        # NOTE: the magnitude too: normalized (Normalize module) or the raw pool
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("normalize", [True, False])
def test_mean_across_prefill_chunks(normalize: bool):
    """A prompt longer than the step budget is computed in chunks; the mean spans them all
    (without a Normalize module its magnitude shows the count it was divided by)."""
    model_dir = embedder_dir("mean", normalize)
    st = SentenceTransformer(str(model_dir), device="cpu")
    long_text = TEXTS[1] * 2
    ids = st.tokenizer(long_text)["input_ids"]
    assert len(ids) > 3 * 32
    ref = st.encode([long_text], convert_to_tensor=True, normalize_embeddings=False)[0]
    core = _core(model_dir, max_num_batched_tokens=32)
    free = core.kv.num_free_blocks
    (vector,), steps = _pool(core, [ids])
    assert steps == -(-len(ids) // 32)
    torch.testing.assert_close(vector, ref.float(), rtol=1e-3, atol=1e-4)
    assert core.kv.num_free_blocks == free


def test_a_checkpoint_without_modules_json_pools_the_last_token_normalized(tmp_path):
    """No sentence-transformers config: vLLM's default for a decoder, the last token's final
    hidden state, normalized (HF's own model computes the states)."""
    from transformers import AutoModel

    model_dir = tmp_path / "plain"  # NOTE: the HF files of a mean-pooling checkpoint
    shutil.copytree(embedder_dir("mean", normalize=False), model_dir, ignore=shutil.ignore_patterns(
        "modules.json", "*sentence*", "1_Pooling", "README.md"))
    hf = AutoModel.from_pretrained(str(model_dir)).eval()
    ids = list(range(300, 340))
    with torch.no_grad():
        states = hf(torch.tensor([ids])).last_hidden_state[0]
    core = _core(model_dir)
    info = core.pooling_info
    assert (info.method, info.normalize, info.source) == ("last", True, "default")
    (vector,), _ = _pool(core, [ids])
    torch.testing.assert_close(vector, F.normalize(states[-1], dim=0), rtol=1e-3, atol=1e-4)


def test_pooling_flag_overrides_the_checkpoint():
    """--pooling mean on a last-token checkpoint: HF's hidden states, mean-pooled here."""
    from transformers import AutoModel

    model_dir = embedder_dir("last")
    hf = AutoModel.from_pretrained(str(model_dir)).eval()
    st = SentenceTransformer(str(model_dir), device="cpu")
    ids = st.tokenizer(TEXTS[0])["input_ids"]
    with torch.no_grad():
        states = hf(torch.tensor([ids])).last_hidden_state[0].double()
    core = _core(model_dir, pooling="mean")
    assert core.pooling_info.source == "--pooling"
    (vector,), _ = _pool(core, [ids])
    assert _cos(vector, F.normalize(states.mean(0), dim=0)) >= 0.9999
    assert abs(vector.norm().item() - 1) < 1e-5  # the checkpoint's Normalize still applies


def test_matryoshka_truncation_then_normalization():
    model_dir = embedder_dir("mean", matryoshka=[32, 16])
    st = SentenceTransformer(str(model_dir), device="cpu")
    ids = st.tokenizer(TEXTS[2])["input_ids"]
    full = st.encode([TEXTS[2]], convert_to_tensor=True, normalize_embeddings=False)[0]
    core = _core(model_dir)
    assert core.pooling_info.matryoshka_dimensions == (32, 16)
    params = SamplingParams(max_tokens=None, pooling=PoolingParams(dimensions=16))
    (vector,), _ = _pool(core, [ids], params)
    assert vector.shape == (16,) and abs(vector.norm().item() - 1) < 1e-5
    assert _cos(vector, full[:16]) >= 0.9999
    with pytest.raises(ValueError, match="dimensions 24"):
        core.add_request(AddRequest(request_id="x", prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=None, pooling=PoolingParams(dimensions=24))))


def test_pooling_beside_generation_keeps_greedy_tokens_and_balances_blocks():
    model_dir = embedder_dir("mean")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    gen_prompts = [[100 + 7 * i + j for i in range(20)] for j in range(3)]

    def generate(with_pooling: bool) -> dict[str, list[int]]:
        core = _core(model_dir, max_num_batched_tokens=48)
        free = core.kv.num_free_blocks
        for j, ids in enumerate(gen_prompts):
            core.add_request(AddRequest(request_id=f"g{j}", prompt_token_ids=ids,
                                        sampling=greedy))
        tokens: dict[str, list[int]] = {}
        pooled, plans = {}, []
        execute = core.runner.execute

        def recording(plan):  # NOTE: which keys each step computed
            plans.append(set(plan.num_scheduled_tokens))
            return execute(plan)

        core.runner.execute = recording
        for step in range(400):
            if not core.has_unfinished_requests():
                break
            if with_pooling and step == 3:  # NOTE: while the generations decode
                for i, text_ids in enumerate([[300 + k for k in range(90)], [5, 6, 7]]):
                    core.add_request(AddRequest(request_id=f"p{i}", prompt_token_ids=text_ids,
                                                sampling=POOL))
            for d in core.step():
                if d.pooled is not None:
                    pooled[d.request_id] = d.pooled
                else:
                    tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        assert not core.has_unfinished_requests()
        assert core.kv.num_free_blocks == free
        if with_pooling:
            assert set(pooled) == {"p0", "p1"}
            # one budget of 48: p0's 90 tokens in two chunks of 45 beside the three decodes,
            # then p1 in the next step
            mixed = [keys for keys in plans if keys & {"p0", "p1"}]
            assert [k - {"g0", "g1", "g2"} for k in mixed] == [{"p0"}, {"p0"}, {"p1"}]
            assert all({"g0", "g1", "g2"} <= keys for keys in mixed)
        return tokens

    alone = generate(False)
    assert generate(True) == alone
    assert all(len(t) == 24 for t in alone.values())


def test_abort_mid_prompt_frees_blocks_and_partial_pool():
    core = _core(embedder_dir("mean"), max_num_batched_tokens=16)
    free = core.kv.num_free_blocks
    core.add_request(AddRequest(request_id="a", prompt_token_ids=list(range(100, 180)),
                                sampling=POOL))
    core.step()
    assert core.kv.num_free_blocks < free
    (d,) = core.abort_requests(["a"])
    assert d.finish_reason == "abort" and d.pooled is None
    while core.has_unfinished_requests():
        core.step()
    core.step()  # NOTE: the plan after the abort tells the runner to drop the row
    assert core.kv.num_free_blocks == free
    assert not core.runner.pooler._partial


def test_pooling_request_validation():
    core = _core(embedder_dir("last"), max_model_len=64)
    with pytest.raises(ValueError, match="context length is 64"):
        core.add_request(AddRequest(request_id="long", prompt_token_ids=[5] * 65,
                                    sampling=POOL))
    core.add_request(AddRequest(request_id="fits", prompt_token_ids=[5] * 64, sampling=POOL))
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, pooling=PoolingParams())


def test_no_prefix_cache_hits_for_pooling():
    """The second embedding of a text whose blocks are cached still pools every position."""
    model_dir = embedder_dir("mean")
    core = _core(model_dir)
    ids = list(range(200, 264))  # four full blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    core.add_request(AddRequest(request_id="g", prompt_token_ids=ids + [7], sampling=greedy))
    while core.has_unfinished_requests():
        core.step()
    assert core.kv.pool.cached  # the generation's prompt blocks are in the prefix cache
    (first,), _ = _pool(core, [ids])
    (second,), _ = _pool(_core(model_dir), [ids])
    torch.testing.assert_close(first, second)
