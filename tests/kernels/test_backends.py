"""The torch backend against float64 on random paged batches, backend selection, and the
flash-attn adapter (only its availability error and argument mapping can run without a GPU).
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from kernel_cases import check_attention, check_write_padding, make_batch, matrix, reference

import kernels
from kernels import auto_backend, get_backend


@pytest.mark.parametrize("case", matrix("torch"), ids=lambda c: "-".join(map(str, c.values())))
def test_torch_backend_matches_float64(case):
    check_attention(**case)


def test_torch_write_kv_skips_padding():
    check_write_padding("torch")


def test_auto_on_cpu_is_the_c_kernel_or_torch():
    assert auto_backend("cpu") in ("cpu", "torch")  # torch only without a C compiler
    assert get_backend("auto", "cpu").__name__ == f"kernels.attention.{auto_backend('cpu')}_backend"
    assert auto_backend("mps") == "torch"


def test_auto_on_cuda_skips_flash_attn_for_another_cache_dtype(monkeypatch):
    """flash_attn reads a cache of the model's dtype only: under an FP8 or float16 cache of
    another dtype, auto takes the next CUDA backend that imports."""
    import importlib

    tried = []

    def fake_import(name):
        tried.append(name)
        return sys  # NOTE: any module: "it imports"

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert auto_backend("cuda") == "flash_attn"
    assert auto_backend("cuda", cache_like_model=False) == "triton"
    assert "kernels.attention.flash_attn_backend" not in tried[1:]


def test_kernels_work_without_triton():
    # sys.modules[name] = None makes `import name` fail, as on a machine without the package
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kernels\n"
        "assert kernels.get_backend('auto', 'cpu').__name__ in ('kernels.attention.cpu_backend', "
        "'kernels.attention.torch_backend')\n"
        "assert kernels.auto_backend('cuda') == 'torch'\n"
        "try:\n"
        "    kernels.get_backend('triton', 'cuda')\n"
        "except ValueError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_flash_attn_missing_is_a_clear_error(monkeypatch):
    # NOTE: None in sys.modules makes an import fail, as on a machine without these builds
    for name in ("flash_attn_interface", "vllm", "vllm.vllm_flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "kernels.attention.flash_attn_backend", raising=False)
    with pytest.raises(ValueError, match="FlashAttention-3.*--attention-backend triton"):
        get_backend("flash_attn", "cuda")


def _fake_fa3(calls: list[dict]) -> types.ModuleType:
    """flash_attn_with_kvcache with FA3's documented semantics, in float64 torch."""

    def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q,
                                max_seqlen_q, softmax_scale, causal, window_size=(-1, -1),
                                softcap=0.0):
        calls.append(dict(page_table=page_table.dtype, causal=causal, max_seqlen_q=max_seqlen_q,
                          window_size=window_size, softcap=softcap))
        page, kvh = k_cache.shape[1], k_cache.shape[2]
        group = q.shape[1] // kvh
        out = torch.empty_like(q)
        for i in range(len(cache_seqlens)):
            s, e, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cache_seqlens[i])
            pos = torch.arange(n)
            blocks = page_table[i].long()[pos // page]
            k = k_cache[blocks, pos % page].double().repeat_interleave(group, 1)
            v = v_cache[blocks, pos % page].double().repeat_interleave(group, 1)
            sc = torch.einsum("qhd,khd->hqk", q[s:e].double(), k) * softmax_scale
            visible = pos[None, :] <= (n - (e - s) + torch.arange(e - s))[:, None]  # bottom-right
            if window_size[0] >= 0:  # left keys before the query's own
                visible &= pos[None, :] >= (n - (e - s) + torch.arange(e - s))[:, None] - (
                    window_size[0])
            if softcap:
                sc = torch.tanh(sc / softcap) * softcap
            sc = sc.masked_fill(~visible, float("-inf"))
            out[s:e] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v).to(q.dtype)
        return out

    return types.SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache)


def test_flash_attn_adapter_maps_metadata_to_fa3(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "flash_attn_interface", _fake_fa3(calls))
    monkeypatch.delitem(sys.modules, "kernels.attention.flash_attn_backend", raising=False)
    try:
        backend = get_backend("flash_attn", "cuda")
        assert backend.KIND == "fa3"
        b = make_batch([(16, 1), (0, 1), (5, 16), (16, 7)], kv_heads=2, group=3, head_dim=32,
                       dtype=torch.float32, kv_dtype=torch.float32, scales=None, page=16,
                       device="cpu", gen=torch.Generator().manual_seed(0))
        # NOTE: its write_kv is the Triton kernel (GPU only here); the torch one fills the cache.
        get_backend("torch").write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
        out = backend.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 1 / math.sqrt(32))
        torch.testing.assert_close(out.double(), reference(b, 1 / math.sqrt(32)))
        assert calls == [dict(page_table=torch.int32, causal=True, max_seqlen_q=16,
                              window_size=(-1, -1), softcap=0.0)]
        windowed = b.meta.with_window(7)
        out = backend.paged_attention(b.q, b.k_cache, b.v_cache, windowed, 1 / math.sqrt(32),
                                      softcap=3.0)
        b.meta = windowed
        torch.testing.assert_close(out.double(), reference(b, 1 / math.sqrt(32), 3.0))
        assert calls[-1]["window_size"] == (6, 0) and calls[-1]["softcap"] == 3.0
        with pytest.raises(ValueError, match="FP8"):
            cache8 = b.k_cache.to(torch.float8_e4m3fn)
            backend.paged_attention(b.q, cache8, cache8, b.meta, 1.0)
    finally:
        sys.modules.pop("kernels.attention.flash_attn_backend", None)
        if hasattr(kernels, "flash_attn_backend"):
            delattr(kernels, "flash_attn_backend")


def test_kv_cache_dtype_is_validated():
    from ipc.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_fp8_kv_cache_is_allocated_in_8_bits(tiny_model_dir):
    from engine.core import EngineCore
    from ipc.config import EngineConfig

    def core(kv: str) -> EngineCore:
        return EngineCore(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                       kv_cache_space=0.01, swap_space=0.001, kv_cache_dtype=kv))

    fp32, fp8 = core("auto"), core("fp8_e4m3")
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    # a quarter of fp32's bytes per block: four times the blocks (up to rounding)
    assert abs(fp8.num_gpu_blocks - 4 * fp32.num_gpu_blocks) < 4
