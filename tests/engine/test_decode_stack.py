"""The one-call decoder stack (engine/models/fused_stack.py, kernels/cpu/csrc/fused.c) on tiny
GGUF files: against the per-layer path on the same model and KV state, and where it must
leave a step to the per-layer path. A Q4_1 file runs packed tiles on AVX-512 and raw-block
segments elsewhere; a Q4_K_M-like file (q/k/gate/up Q4_K, v and down Q6_K: two segments in
one fused qkv) runs raw-block segments on every CPU (loaded packing nothing), and on AVX-512
VNNI also quant_kpacked.c's tiles (loaded as usual: the K-quants pack). A tiny Gemma 3 in
the real 270M file's mix (q/k Q5_0, v Q8_0: two libraries' tiles in one qkv) brings q/k
norms, the sandwich norms, windows and the local rope, packed where the CPU packs and as raw
blocks. Greedy parity with `--quantization none` while the stack runs is checked in
test_quantized.py (test_gguf_a32_equals_dequantized), with HF on the real Gemma 3 270M in
test_gemma3_270m.py.
"""

from __future__ import annotations

import c_build
import pytest
import torch
from decode_steps import copy_caches, decode_batch, forward, random_state
from tiny_families import WINDOW, build_family
from tiny_gguf import write_gguf
from tiny_quant_gguf import write_tiny_gguf

from engine import LLM, SamplingParams
from engine.models.forward_context import ForwardContext, forward_context
from kernels.attention import cpu_backend, torch_backend
from kernels.cpu import fused as cpu_fused
from kernels.cpu import kquant as cpu_kquant
from kernels.cpu import quant as cpu_quant
from kernels.cpu.ggml_types import Q4_K, Q5_0, Q6_K, Q8_0

Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K"}  # the overrides on a Q4_K file


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_fused.available() else cpu_fused.build_error())


@pytest.fixture(scope="module")
def q4_1_gguf(tiny_model_dir, tmp_path_factory):
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("stack") / "q4_1.gguf",
                           "Q4_1")


@pytest.fixture(scope="module")
def q4_k_m_gguf(wide_model_dir, tmp_path_factory):
    return write_tiny_gguf(wide_model_dir, tmp_path_factory.mktemp("stack") / "q4_k_m.gguf",
                           "Q4_K", overrides=Q4_K_M)


@pytest.fixture(scope="module")
def gemma3_gguf(bundled_tokenizer_dir, tmp_path_factory):
    """Gemma 3 (two windowed layers with the local rope, one global) in Q5_0, v in Q8_0."""
    root = tmp_path_factory.mktemp("gemma3")
    hf = build_family("gemma3", root / "hf", bundled_tokenizer_dir, query_pre_attn_scalar=16)
    return write_gguf(hf, root / "gemma3.gguf", "gemma3", dtype="Q5_0",
                      overrides={"attn_v": "Q8_0"})


@pytest.fixture(scope="module", params=["Q4_1-a32", "Q4_1-a8", "Q4_K_M-a32", "Q4_K_M-a8",
                                        "Q4_K_M-packed-a32", "Q4_K_M-packed-a8",
                                        "Gemma3-a32", "Gemma3-a8", "Gemma3-raw-a8"])
def llm(request, q4_1_gguf, q4_k_m_gguf, gemma3_gguf, bundled_tokenizer_dir):
    kind, *flags, numerics = request.param.split("-")
    path = {"Q4_1": q4_1_gguf, "Q4_K_M": q4_k_m_gguf, "Gemma3": gemma3_gguf}[kind]
    if flags == ["packed"]:
        c_build.require_isa("avx512", cpu_kquant.available())
    with pytest.MonkeyPatch.context() as patch:
        if (kind == "Q4_K_M" and not flags) or flags == ["raw"]:
            # NOTE: raw-block segments on every CPU: this load packs none
            patch.setattr(cpu_quant, "packs", lambda type_id, k: False)
        return LLM(str(path), tokenizer=str(bundled_tokenizer_dir), max_model_len=256,
                   num_gpu_blocks=64, quantization="gguf", quantization_numerics=numerics)


@pytest.mark.parametrize("kv_dtype", list(cpu_fused.KV_DTYPES))
@pytest.mark.parametrize("lens", [[1], [40], [1, 17, 40, 100], [16, 33, 250, 2, 64, 5, 129]])
def test_stack_equals_the_per_layer_path(llm, lens, kv_dtype, request):
    """Same model, same KV state: the same hidden states and KV writes, for each pool dtype
    the driver takes. NOTE: tolerance 0: the driver calls the per-layer path's own kernels
    with the same arguments (seen bit-equal for a32 and a8)."""
    runner = llm.engine.runner
    model, stack = runner.model, runner.model.decode_stack
    assert stack is not None
    qkv = model.layers[0].self_attn.qkv_proj
    types = [s[1] for s in qkv.packed_segments or qkv.block_segments]
    if Q4_K in types:
        assert types == [Q4_K, Q6_K]  # q|k, then v: two in one product
        # NOTE: the K-quants' tiles where they pack, else raw blocks
        assert (qkv.packed_segments is not None) == ("packed" in request.node.callspec.id)
    if Q5_0 in types:  # Gemma 3: what the stack takes beyond the Llama layer
        assert types == [Q5_0, Q8_0]
        assert [layer.self_attn.window for layer in model.layers] == [WINDOW, WINDOW, None]
        assert [layer.uses_local_rope for layer in model.layers] == [True, True, False]
        assert model.layers[0].self_attn.q_norm is not None
        assert ((qkv.packed_segments is not None)
                == ("raw" not in request.node.callspec.id and cpu_kquant.available()))
    gen = torch.Generator().manual_seed(len(lens))
    state = random_state(runner, gen, kv_dtype)
    ids, positions, meta = decode_batch(lens, [1] * len(lens), runner.block_size, gen)
    for num_layers in (None, 1):  # all layers, and the self draft's first layer
        calls = stack.calls
        fused_caches = copy_caches(state)
        fused = forward(model, fused_caches, meta, ids, positions, num_layers=num_layers)
        assert stack.calls == calls + 1
        model.decode_stack = None
        try:
            layer_caches = copy_caches(state)
            ref = forward(model, layer_caches, meta, ids, positions, num_layers=num_layers)
        finally:
            model.decode_stack = stack
        assert torch.equal(fused, ref)
        for (fk, fv), (rk, rv) in zip(fused_caches, layer_caches, strict=True):
            assert torch.equal(fk, rk) and torch.equal(fv, rv)


def test_steps_the_stack_does_not_take_fall_back(llm):
    """A mixed step (a prefill chunk beside decodes), the torch backend, pools of a dtype
    the driver does not take (FP8, bfloat16; float16 it takes), too many rows: the per-layer
    path runs and the counter stays."""
    runner = llm.engine.runner
    model, stack = runner.model, runner.model.decode_stack
    gen = torch.Generator().manual_seed(1)
    state = random_state(runner, gen)
    calls = stack.calls
    mixed = decode_batch([20, 9], [1, 5], runner.block_size, gen)
    forward(model, copy_caches(state), mixed[2], *mixed[:2])
    decode = decode_batch([20, 9], [1, 1], runner.block_size, gen)
    forward(model, copy_caches(state), decode[2], *decode[:2], backend=torch_backend)
    for dtype, takes in ((torch.float8_e4m3fn, False), (torch.float16, True),
                         (torch.bfloat16, False)):
        fit = stack.kernel.caches_fit([(k.to(dtype), v.to(dtype)) for k, v in state])
        assert fit == takes, dtype
    assert not stack.kernel.caches_fit(state[:1])  # fewer pools than layers
    wide = decode_batch([3] * 65, [1] * 65, runner.block_size, gen)
    with forward_context(ForwardContext(wide[2], state, cpu_backend)):
        assert not stack.fits(torch.zeros(65, model.cfg.hidden_size), wide[1], None)
    assert stack.calls == calls


def test_models_the_stack_does_not_take(tiny_model_dir, bundled_tokenizer_dir, tmp_path):
    """A projection with a dense segment (v in F16 beside q/k tiles), a dense model, the
    torch backend, attention soft-capping (Gemma 2's; decode.c has none): no stack."""
    tok = str(bundled_tokenizer_dir)
    dense = LLM(str(tiny_model_dir), tokenizer=tok, max_model_len=64, num_gpu_blocks=8)
    assert dense.engine.runner.model.decode_stack is None
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "q4_1.gguf", "Q4_1")
    on_torch = LLM(str(path), tokenizer=tok, max_model_len=64, num_gpu_blocks=8,
                   attention_backend="torch")
    assert on_torch.engine.runner.model.decode_stack is None
    mixed = write_tiny_gguf(tiny_model_dir, tmp_path / "mixed.gguf", "Q4_1",
                            overrides={"attn_v": "F16"})
    part_dense = LLM(str(mixed), tokenizer=tok, max_model_len=64, num_gpu_blocks=8)
    assert part_dense.engine.runner.model.decode_stack is None
    gemma2 = build_family("gemma2", tmp_path / "gemma2", bundled_tokenizer_dir,
                          query_pre_attn_scalar=16)
    capped = LLM(str(write_gguf(gemma2, tmp_path / "gemma2.gguf", "gemma2", dtype="Q8_0")),
                 tokenizer=tok, max_model_len=64, num_gpu_blocks=8)
    model = capped.engine.runner.model
    assert model.layers[0].mlp.fused is not None  # quantized, and yet
    assert model.decode_stack is None


def test_self_draft_and_verification_keep_greedy_output(q4_1_gguf, bundled_tokenizer_dir):
    """The self draft's steps run the stack's first layer; the verification steps (several
    tokens per row) fall back; greedy output equals the plain run's."""
    prompts = [{"prompt_token_ids": [(7 * i + k) % 300 + 100 for i in range(10)] * 2}
               for k in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = []
    for options in ({}, {"speculative_method": "self", "speculative_draft_layers": 1,
                         "num_speculative_tokens": 2}):
        llm = LLM(str(q4_1_gguf), tokenizer=str(bundled_tokenizer_dir), max_model_len=128,
                  num_gpu_blocks=32, quantization="gguf", **options)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        stack = llm.engine.runner.model.decode_stack
        assert stack.calls > 0
        # NOTE: the draft's one-layer steps went through the stack (none without drafts)
        assert (stack.partial_calls > 0) == bool(options)
    assert outs[0] == outs[1]
