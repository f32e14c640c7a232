"""Cross-encoders (`*ForSequenceClassification` checkpoints) in EngineCore against
sentence-transformers' CrossEncoder on the same tiny random checkpoints: the score head on the
last non-pad token, sigmoid, pairs tokenized by the tokenizer's text-pair call; chunked prefill;
generation refused; several labels, another activation and --pooling refused."""

from __future__ import annotations

import json

import pytest
from sentence_transformers import CrossEncoder
from tiny_cross_encoder import cross_encoder_dir

from engine.core import EngineCore
from engine.models.config import from_hf_config
from engine.models.pooling_config import pooling_info
from ipc.config import EngineConfig
from ipc.messages import AddRequest
from ipc.pooling import PoolingParams
from ipc.sampling import SamplingParams

POOL = SamplingParams(max_tokens=None, pooling=PoolingParams())
# NOTE: the last pair's document ends with the pad token (`<|im_end|>`, id 2): HF's head
# reads the token before it; the second is longer than a step's budget (three chunks)
PAIRS = [("What is paged attention?", "The KV cache is kept in fixed-size blocks."),
         ("What is paged attention?", "A cat sat on the mat. " * 12),
         ("Where is the cat?", "On the mat<|im_end|>")]


def _scores(core: EngineCore, prompts: list[list[int]]) -> list[float]:
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(request_id=f"s{i}", prompt_token_ids=ids, sampling=POOL))
    out: dict[str, list[float]] = {}
    for _ in range(50):
        if not core.has_unfinished_requests():
            break
        for d in core.step():
            assert d.finished and d.finish_reason == "stop" and d.pooled is not None, d
            out[d.request_id] = d.pooled
    assert all(len(v) == 1 for v in out.values())
    return [out[f"s{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_scores_match_sentence_transformers_cross_encoder(family):
    model_dir = cross_encoder_dir(family)
    ce = CrossEncoder(str(model_dir), device="cpu")
    want = [float(x) for x in ce.predict(PAIRS)]
    prompts = [ce.tokenizer(q, d)["input_ids"] for q, d in PAIRS]
    assert prompts[2][-1] == 2 and len(prompts[1]) > 2 * 32
    core = EngineCore(EngineConfig(model=str(model_dir), num_gpu_blocks=64, block_size=16,
                                   max_num_batched_tokens=32))
    info = core.pooling_info
    assert (info.num_labels, info.method, info.normalize, info.source) == (1, "last", False,
                                                                          "classifier")
    free = core.kv.num_free_blocks
    got = _scores(core, prompts)
    assert got == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 0.05  # NOTE: scores that differ: the pairs matter
    assert core.kv.num_free_blocks == free
    with pytest.raises(ValueError, match="does not generate"):
        core.add_request(AddRequest(request_id="g", prompt_token_ids=prompts[0],
                                    sampling=SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="no pooling method or dimensions"):
        core.add_request(AddRequest(request_id="m", prompt_token_ids=prompts[0], sampling=(
            SamplingParams(max_tokens=None, pooling=PoolingParams(method="mean")))))


def _config(tmp_path, **fields):
    base = dict(model_type="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=2,
                architectures=["Qwen3ForSequenceClassification"])
    (tmp_path / "config.json").write_text(json.dumps(base | fields))
    return tmp_path


def test_what_is_refused(tmp_path):
    labels = {"0": "a", "1": "b", "2": "c"}
    with pytest.raises(ValueError, match="with 3 labels"):
        from_hf_config(_config(tmp_path, id2label=labels))
    with pytest.raises(ValueError, match="activation torch.nn.modules.linear.Identity"):
        from_hf_config(_config(tmp_path, id2label={"0": "x"}, sentence_transformers={
            "activation_fn": "torch.nn.modules.linear.Identity"}))
    cfg = from_hf_config(_config(tmp_path, id2label={"0": "x"}, pad_token_id=7))
    assert (cfg.num_labels, cfg.pad_token_id) == (1, 7)
    assert from_hf_config(_config(tmp_path, architectures=["Qwen3ForCausalLM"])).num_labels is None
    with pytest.raises(ValueError, match="pooling mean: this model is a cross-encoder"):
        pooling_info(None, 1, "mean", 1)
