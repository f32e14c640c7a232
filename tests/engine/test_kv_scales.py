"""FP8 KV cache scales from the checkpoint: loaded per tensor or per head, passed to the
kernels only with an FP8 cache, and exact on a model whose K/V exceed FP8's range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_llama import build_tiny_llama

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, kv_scale_name
from engine.parallel.layers import _local_scale, shard_plan
from kernels.attention import torch_backend

LAYERS, KV_HEADS = 2, 2
# K and V projections times GAIN, Q and O projections divided by it: the same model in exact
# arithmetic (a power of two scales floats exactly), but |k| and |v| reach thousands where FP8
# E4M3 tops out at 448.
GAIN = 2.0**14
ATTENTION = 64.0  # NOTE: a random tiny model's residual stream otherwise drowns its attention


def _with_scales(src: Path, dst: Path, scales: dict[str, torch.Tensor], gain: float) -> Path:
    """A copy of the tiny checkpoint made loud by `gain`, with extra tensors; its attention
    output is made ATTENTION times larger so that what the cache holds shows in the tokens."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * gain
        elif name.endswith("q_proj.weight"):
            tensors[name] = tensors[name] / gain
        elif name.endswith("o_proj.weight"):
            tensors[name] = tensors[name] * (ATTENTION / gain)
    save_file({**tensors, **scales}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def loud_models(tmp_path_factory, bundled_tokenizer_dir):
    """The tiny model as is, and loud without scales, with per-head ones and per-tensor ones."""
    root = tmp_path_factory.mktemp("kv-scales")
    # NOTE: untied embeddings: a tied random model repeats one token whatever its attention does
    base = build_tiny_llama(root / "base", bundled_tokenizer_dir, seed=3, tie_word_embeddings=False)
    per_head = {f"model.layers.{i}.self_attn.{kv}_scale": torch.full((KV_HEADS,), GAIN)
                for i in range(LAYERS) for kv in "kv"}
    per_tensor = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(GAIN)
                  for i in range(LAYERS)}
    models = {name: _with_scales(base, root / name, scales, GAIN)
              for name, scales in (("none", {}), ("head", per_head), ("tensor", per_tensor))}
    return {"quiet": _with_scales(base, root / "quiet", {}, 1.0), **models}


def test_scale_names():
    assert kv_scale_name("layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_name("layers.0.self_attn.v_proj.output_scale") == (0, "v")
    assert kv_scale_name("layers.1.self_attn.kv_scale") == (1, "kv")
    assert kv_scale_name("layers.1.self_attn.k_proj.weight") is None


def test_bad_scales_are_refused():
    cfg = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=2)
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="one per KV head"):
        model.set_kv_scale(0, "k", torch.ones(3))
    with pytest.raises(ValueError, match="positive"):
        model.set_kv_scale(0, "v", torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="has 1 layers"):
        model.set_kv_scale(1, "k", torch.tensor(2.0))
    model.set_kv_scale(0, "kv", torch.tensor([2.0]))
    attn = model.layers[0].self_attn
    assert attn.k_scale.shape == () and float(attn.v_scale) == 2.0


def test_tensor_parallel_ranks_keep_their_heads_scales():
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=8, num_kv_heads=4, head_dim=2)
    per_head = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert _local_scale(shard_plan(cfg, 1, 2), per_head).tolist() == [3.0, 4.0]
    assert _local_scale(shard_plan(cfg, 1, 2), torch.tensor(5.0)).tolist() == [5.0]


def _run(model_dir: Path, kv_cache_dtype: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), kv_cache_dtype=kv_cache_dtype, attention_backend="torch",
              max_model_len=256, num_gpu_blocks=64)
    prompts = [f"Item {i}: the quick brown fox jumps over the lazy dog" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


def test_scales_reach_the_kernels_only_with_an_fp8_cache(loud_models, monkeypatch):
    seen = []
    real = torch_backend.write_kv

    def spy(*args, k_scale=None, v_scale=None):
        seen.append((k_scale, v_scale))
        return real(*args, k_scale=k_scale, v_scale=v_scale)

    monkeypatch.setattr(torch_backend, "write_kv", spy)
    llm, _ = _run(loud_models["head"], "fp8_e4m3")
    attn = llm.engine.runner.model.layers[0].self_attn
    assert attn.k_scale.tolist() == [GAIN] * KV_HEADS == attn.v_scale.tolist()
    assert seen and all(k is not None and v is not None for k, v in seen)
    seen.clear()
    _run(loud_models["head"], "auto")  # a float cache stores x as is
    assert seen and all(k is None and v is None for k, v in seen)


def test_scales_make_a_loud_model_exactly_the_quiet_one(loud_models):
    """With scales equal to the gain the FP8 cache stores the quiet model's values bit for bit,
    so greedy output is identical; without them the cache saturates at 448 and it drifts."""
    _, quiet = _run(loud_models["quiet"], "fp8_e4m3")
    _, quiet_float = _run(loud_models["quiet"], "auto")
    assert _run(loud_models["none"], "auto")[1] == quiet_float  # the loud model is the same model
    assert _run(loud_models["head"], "fp8_e4m3")[1] == quiet
    assert _run(loud_models["tensor"], "fp8_e4m3")[1] == quiet
    saturated = _run(loud_models["none"], "fp8_e4m3")[1]
    same = sum(a == b for x, y in zip(saturated, quiet, strict=True)
               for a, b in zip(x, y, strict=True))
    assert same < 0.5 * sum(len(x) for x in quiet), saturated
