"""The float16 KV cache on the CPU (--kv-cache-dtype float16): csrc/decode.c's paged_decode_f16
and write_kv_f16 against float64 attention over the same float16-rounded K/V and against
torch's float16 cast, the portable conversion (a build without F16C), and the engine's greedy
tokens and log-probs beside a float32 cache."""

from __future__ import annotations

import ctypes
import math

import c_build
import numpy as np
import pytest
import torch
from agreement import greedy_agreement
from kernel_cases import TOLERANCES, check_attention, make_batch, reference
from tiny_llama import build_tiny_llama

from kernels.attention import torch_backend
from kernels.cpu import library

try:
    from kernels.attention import cpu_backend
except ImportError as e:
    cpu_backend, BUILD_ERROR = None, str(e)
else:
    BUILD_ERROR = None

# NOTE: float16 K/V hold about 3 significant digits, but the reference attends over the same
# rounded values in float64, so only the kernel's float32 arithmetic is left: float32's
# tolerances (the widening is exact).
F32_TOL = TOLERANCES[torch.float32]


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(BUILD_ERROR)


# head_dim 64 and 128: the vectorized attend (groups 1-8); 32 and 24: the scalar one
@pytest.mark.parametrize(("batch", "group", "head_dim", "page"), [
    ("decode", 1, 64, 16), ("decode", 3, 64, 16), ("mixed", 4, 64, 16), ("long", 8, 64, 16),
    ("long", 3, 128, 16), ("mixed", 3, 64, 8), ("long", 2, 64, 32), ("mixed", 3, 32, 16),
    ("decode", 12, 24, 16)])
def test_f16_cache_decode_matches_float64(batch, group, head_dim, page):
    check_attention("cpu", batch, group=group, head_dim=head_dim, page=page,
                    kv_dtype="float16", seed=group * 1000 + head_dim + page)


@pytest.mark.parametrize("window", [1, 17, 1000])
def test_f16_cache_windows_match_float64(window):
    check_attention("cpu", "window", group=4, head_dim=64, kv_dtype="float16", window=window,
                    seed=window)


@pytest.mark.parametrize(("seqs", "num_threads"), [([(2100, 1)], 2), ([(600, 1), (3, 1)], 8)])
def test_f16_split_kv_decode_matches_float64(seqs, num_threads):
    gen = torch.Generator().manual_seed(num_threads)
    b = make_batch(seqs, kv_heads=1, group=3, head_dim=64, dtype=torch.float32,
                   kv_dtype=torch.float16, scales=None, page=16, device="cpu", gen=gen)
    cpu_backend.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    out = torch.full_like(b.q, float("nan"))
    assert cpu_backend.fits(b.q, b.k_cache, b.v_cache, out, None, None, b.meta)
    scale = 1 / math.sqrt(64)
    cpu_backend.decode(b.q, b.k_cache, b.v_cache, b.meta, scale, out, num_threads=num_threads)
    torch.testing.assert_close(out.double(), reference(b, scale), atol=F32_TOL[0],
                               rtol=F32_TOL[1])


def _hard_floats(n: int, seed: int) -> torch.Tensor:
    """Normals, float16 subnormals, ties, values near and past 65504, signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 17, (n,), generator=gen)
                                                      .float())
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = halves[torch.isfinite(halves)]
    ties = (finite[:-1] + finite[1:]) / 2  # exactly halfway between neighbours: ties to even
    edge = torch.tensor([65504.0, 65519.99, 65520.0, 7e4, -7e4, 0.0, -0.0, 2.0**-25,
                         2.0**-25 * 1.0001, 2.0**-24, 6.1e-5, float("inf"), float("-inf")])
    return torch.cat([wide, finite, ties[torch.isfinite(ties)], edge])


def test_f16_write_rounds_as_torch_casts():
    """Every value written is torch's float16 cast of it saturated at +-65504 (no inf: a later
    request's masked p = 0 must not meet one), bit for bit (vector body and scalar tail:
    width 24 = 16 + 8); slot -1 is skipped and nothing else changes."""
    x = _hard_floats(4096, 0)
    width = 24
    rows = x[: x.numel() // width * width].view(-1, 1, width)
    slots = torch.randperm(rows.shape[0] + 5)[: rows.shape[0]]
    slots[3] = -1
    k_cache = torch.full((rows.shape[0] + 5, 1, 1, width), 7.0, dtype=torch.float16)
    v_cache = k_cache.clone()
    cpu_backend.write_kv(rows, -rows, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, width), v_cache.view(-1, width)
    keep = slots >= 0
    want = rows[keep, 0].clamp(-65504.0, 65504.0).to(torch.float16)
    assert bool(torch.isfinite(want).all()) and bool((rows.abs() >= 65520).any())
    assert torch.equal(flat_k[slots[keep]].view(torch.int16), want.view(torch.int16))
    assert torch.equal(flat_v[slots[keep]].view(torch.int16), (-want).view(torch.int16))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool((flat_k[untouched] == 7.0).all()) and bool((flat_v[untouched] == 7.0).all())
    # and back: the decode reads exactly the float32 value of each stored half (widening)
    assert torch.equal(flat_k[slots[keep]].float(), want.float())
    # the torch backend's writes (prefill chunks with softcaps, odd shapes): the same bits
    k_torch, v_torch = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    torch_backend.write_kv(rows, -rows, k_torch, v_torch, slots)
    assert torch.equal(k_torch.view(torch.int16), k_cache.view(torch.int16))
    assert torch.equal(v_torch.view(torch.int16), v_cache.view(torch.int16))


@pytest.fixture(scope="module")
def portable_lib() -> ctypes.CDLL:
    """The CPU library built for baseline x86-64 (no F16C, no AVX): the portable conversions."""
    def portable(flags: list[str]) -> list[str]:
        # NOTE: -O2 (the last -O wins): decode.c at -O3 for baseline x86-64 takes 68 s to build
        # (kernels/cpu/library.py's DECODE); what is tested is the portable code, not its speed
        return [f for f in flags if not f.startswith("-march")] + ["-march=x86-64", "-O2"]

    try:
        return library.build(portable)
    except ImportError as e:
        c_build.require(str(e))


def test_portable_conversions_equal_numpy(portable_lib):
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = np.empty(65536, dtype=np.float32)
    portable_lib.half_bits_to_float_n(halves.ctypes.data, got.ctypes.data, 65536)
    want = halves.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[np.isnan(want)]).all() and np.array_equal(got[np.isinf(want)],
                                                                  want[np.isinf(want)])
    x = _hard_floats(20000, 1).numpy()
    bits = np.empty(x.size, dtype=np.uint16)
    portable_lib.float_to_half_bits_n(x.ctypes.data, bits.ctypes.data, x.size)
    with np.errstate(over="ignore"):  # past 65504: inf, as intended
        want16 = x.astype(np.float16)
    assert np.array_equal(bits, want16.view(np.uint16))
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    portable_lib.float_to_half_bits_n(nan.ctypes.data, bits.ctypes.data, 2)
    assert np.isnan(bits[:2].view(np.float16)).all()


def test_portable_decode_matches_float64(portable_lib):
    """The portable build's paged_decode_f16 (scalar widening inside the vector attend)."""
    gen = torch.Generator().manual_seed(7)
    b = make_batch([(300, 1), (40, 1), (5, 1)], kv_heads=2, group=3, head_dim=64,
                   dtype=torch.float32, kv_dtype=torch.float16, scales=None, page=16,
                   device="cpu", gen=gen)
    cpu_backend.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    out = torch.full_like(b.q, float("nan"))
    scale = 1 / math.sqrt(64)
    t = b.meta.block_tables
    portable_lib.paged_decode_f16(
        b.q.data_ptr(), b.q.stride(0), b.k_cache.data_ptr(), b.v_cache.data_ptr(),
        t.data_ptr(), t.stride(0), b.meta.seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
        3, 6, 2, 64, 16, ctypes.c_float(scale), 0, 2)
    torch.testing.assert_close(out.double(), reference(b, scale), atol=F32_TOL[0],
                               rtol=F32_TOL[1])


# ---- the engine --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head64_model_dir(tmp_path_factory, bundled_tokenizer_dir):
    """head_dim 64 (hidden 256, 4 heads, 2 KV heads): the kernel's vectorized attend."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-head64"), bundled_tokenizer_dir,
                            hidden_size=256, intermediate_size=512)


def _greedy(model_dir, kv_cache_dtype: str):
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_dtype=kv_cache_dtype, attention_backend="cpu",
              device="cpu", max_model_len=256, num_gpu_blocks=64, max_num_batched_tokens=32)
    prompts = [[1, 422, 3110, 2706], [1] + list(range(300, 360)), [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outs


def test_engine_f16_cache_is_close_to_float32(head64_model_dir, capsys):
    """Greedy tokens with a float16 cache against a float32 one: agreement reported; while the
    tokens agree, the top-5 log-probs within 2e-3 of each other (float16 K/V carry a relative
    error of at most 2^-11; the worst seen here is printed). The random model is peaked (its
    chosen token's log-prob rounds to 0), so the runners-up carry the comparison."""
    llm16, f16 = _greedy(head64_model_dir, "float16")
    assert llm16.engine.runner.kv_caches[0][0].dtype == torch.float16
    del llm16
    _, f32 = _greedy(head64_model_dir, "auto")
    same, total, worst = greedy_agreement(f16, f32)
    with capsys.disabled():
        print(f"\nfloat16 vs float32 KV (tiny head-64 Llama): {same}/{total} greedy tokens "
              f"agree before the first difference; max top-5 log-prob difference {worst:.2e}")
    assert same >= total * 3 // 4
    assert 0 < worst < 2e-3  # NOTE: > 0: the float16 cache really rounded what it stored


def test_kv_cache_dtype_float16_is_accepted_and_others_named():
    import argparse

    from ipc.config import EngineConfig, add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for name in ("float16", "half"):
        cfg = config_from_args(parser.parse_args(["--kv-cache-dtype", name]))
        assert cfg.kv_cache_dtype == name and cfg.to_cli_args() == ["--kv-cache-dtype", name]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float64")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "bfloat17"])


def test_f16_cache_swap_and_copy_on_write_keep_the_tokens(tiny_model_dir):
    """A float16 pool short of blocks (preempted by swap to a float16 CPU pool) gives the
    tokens of a roomy one; n = 2 sharing a prompt (copy-on-write) and a repeated prompt
    (prefix cache) too."""
    from engine.core import EngineCore
    from ipc.config import EngineConfig
    from ipc.messages import AddRequest
    from ipc.sampling import SamplingParams

    prompts = [[(7 * i + j) % 40000 + 100 for i in range(30)] for j in range(3)] * 2
    runs = []
    for blocks in (200, 24):
        core = EngineCore(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="float16",
                                       num_gpu_blocks=blocks, block_size=4,
                                       preemption_mode="swap", swap_space=0.01))
        assert core.runner.cpu_caches[0][0].dtype == torch.float16
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True,
                                    n=2 if i == 0 else 1)
            core.add_request(AddRequest(request_id=str(i), prompt_token_ids=p,
                                        sampling=params))
        out: dict[tuple[str, int], list[int]] = {}
        for _ in range(1000):
            if not core.has_unfinished_requests():
                break
            for d in core.step():
                out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        assert not core.has_unfinished_requests()
        assert (core.scheduler.preemptions.swap > 0) == (blocks == 24)
        assert core.kv.num_free_blocks == blocks
        runs.append(out)
    assert runs[0] == runs[1] and len(runs[0]) == 7


def test_flash_attn_with_another_cache_dtype_is_refused_at_start(tiny_model_dir):
    from engine.core import EngineCore
    from ipc.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype float16: the flash_attn backend"):
        EngineCore(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="float16",
                                attention_backend="flash_attn", num_gpu_blocks=16))
