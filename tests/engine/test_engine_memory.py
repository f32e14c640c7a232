"""The engine's resident memory: the CPU KV pool is committed as it is written (zeros that
cost no resident memory until a block is written, engine.allocator.untouched_zeros, read as
0.0 before that); the engine process does not import what it never uses."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from engine.allocator import resident_bytes, untouched_zeros

MIB = 2**20


def test_untouched_zeros_grow_with_what_is_written():
    pools = untouched_zeros(4, (512, 16, 2, 64), torch.float16)  # 4 x 2 MiB, one mapping
    assert all(p.is_contiguous() and p.dtype == torch.float16 for p in pools)
    assert resident_bytes(pools[0]) < MIB // 4  # nothing resident yet (at most a few pages)
    # reading maps the zero page: every slot is 0.0, and nothing becomes resident
    assert all(float(p.float().abs().sum()) == 0.0 for p in pools)
    assert resident_bytes(pools[0]) < MIB // 4
    pools[1][:256] = 1.0  # 1 MiB written
    grown = resident_bytes(pools[0])
    assert MIB <= grown < MIB + MIB // 4
    pools[3].fill_(2.0)  # 2 MiB more
    assert 3 * MIB <= resident_bytes(pools[2]) < 3 * MIB + MIB // 4
    assert float(pools[0].float().abs().sum()) == 0.0 and bool((pools[3] == 2.0).all())


def test_engine_pool_is_resident_only_where_requests_wrote(tiny_model_dir):
    from engine import LLM, SamplingParams

    # 2 layers x (K, V) x 4096 blocks x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 32 MiB
    llm = LLM(str(tiny_model_dir), device="cpu", max_model_len=256, num_gpu_blocks=4096,
              swap_space=0.01)
    caches = llm.engine.runner.kv_caches
    pool_bytes = sum(2 * k.numel() * k.element_size() for k, _ in caches)
    assert pool_bytes == 32 * MIB
    at_ready = resident_bytes(caches[0][0])
    assert at_ready < MIB // 4
    outs = llm.generate([{"prompt_token_ids": [1] + list(range(300, 400))}] * 4,
                        SamplingParams(temperature=0.0, max_tokens=20))
    assert all(len(o.token_ids) == 20 for o in outs)
    used = resident_bytes(caches[0][0])
    # NOTE: the requests hold a few dozen 2 KiB blocks per layer tensor (the prompt's shared
    # through the prefix cache), page-rounded: 256 KiB of the 32 MiB pool when written
    assert at_ready < used < MIB


def test_the_engine_process_reads_gguf_without_mistral_common():
    """`python -m engine` marks gguf's optional vocabulary backend absent; GGUF files still
    read (the bundled model's metadata and tensors)."""
    # NOTE: a test dependency (make setup installs it): without it this would prove nothing
    assert importlib.util.find_spec("mistral_common") is not None
    code = ("import sys\n"
            "from engine.__main__ import skip_unneeded_imports\n"
            "skip_unneeded_imports()\n"
            "import gguf\n"
            "from ipc.model_source import bundled_gguf\n"
            "reader = gguf.GGUFReader(str(bundled_gguf()))\n"
            "assert len(reader.tensors) > 200, len(reader.tensors)\n"
            "assert sys.modules['mistral_common'] is None\n"
            "assert 'pydantic' not in sys.modules\n")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_a_model_without_dense_linears_skips_the_packing_probes():
    """auto packs nothing for a model with no nn.Linear (a quantized one), and does not run
    dual's MKL probe (it pages in code nothing else runs)."""
    from engine.models import cpu_linear

    before = cpu_linear.mkl_packed_available.cache_info()
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.ReLU())
    mode = cpu_linear.resolve_mode("auto", model, torch.device("cpu"), torch.float32)
    assert mode == "torch"
    cpu_linear.pack_linears(model, mode)
    assert cpu_linear.mkl_packed_available.cache_info() == before
