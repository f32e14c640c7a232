"""The engine's resident memory: the CPU KV pool is committed as it is written (zeros that
cost no resident memory until a block is written, engine.allocator.untouched_zeros, read as
0.0 before that); packed weights lie in huge-page mappings (engine.allocator.WeightArena);
the engine process does not import what it never uses."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from engine.allocator import HUGE_PAGE, WeightArena, resident_bytes, untouched_zeros

MIB = 2**20
THP = Path("/sys/kernel/mm/transparent_hugepage")  # absent: a kernel without huge pages


def _mapping(address: int) -> tuple[int, set[str]]:
    """(start, VmFlags) of this process's mapping that holds `address` (/proc/self/smaps)."""
    start = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            start = lo if lo <= address < hi else None
        elif start is not None and head == "VmFlags:":
            return start, set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_weight_arena_hands_out_disjoint_aligned_buffers_on_huge_page_mappings():
    arena = WeightArena(chunk=4 * MIB)
    sizes = [100, 5000, 3 * MIB, 6 * MIB, 64, 1]  # 6 MiB: more than a chunk, a mapping of its own
    bufs = [arena.empty(n) for n in sizes]
    for i, (b, n) in enumerate(zip(bufs, sizes, strict=True)):
        assert b.dtype == torch.uint8 and b.numel() == n and b.is_contiguous()
        assert b.data_ptr() % 64 == 0
        b.fill_(i)
        start, flags = _mapping(b.data_ptr())
        # MADV_HUGEPAGE: the kernel may back it with 2 MiB pages (where it has them at all)
        assert "hg" in flags or not THP.exists()
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap
    assert all(bool((b == i).all()) for i, b in enumerate(bufs))  # nothing written over
    # each new mapping starts on a 2 MiB boundary: the first chunk (100 B, 5000 B and 3 MiB
    # in it), the 6 MiB one, and the next chunk after it (64 B)
    assert all(bufs[i].data_ptr() % HUGE_PAGE == 0 for i in (0, 3, 4))
    assert bufs[2].data_ptr() - bufs[0].data_ptr() < 4 * MIB


def test_a_gguf_models_packed_tiles_lie_in_the_arena(tiny_model_dir, bundled_tokenizer_dir,
                                                     tmp_path):
    """Where this CPU packs Q4_1 (AVX-512 VNNI), every packed part of the loaded model sits in
    a huge-page mapping; elsewhere nothing is packed and the raw blocks stay where they are."""
    from tiny_quant_gguf import write_tiny_gguf

    from engine import LLM
    from engine.models.quant_linear import QuantLinear
    from kernels.cpu import quant as cpu_quant

    path = write_tiny_gguf(tiny_model_dir, tmp_path / "q4_1.gguf", "Q4_1")
    llm = LLM(str(path), tokenizer=str(bundled_tokenizer_dir), max_model_len=64,
              num_gpu_blocks=8, quantization="gguf")
    model = llm.engine.runner.model
    parts = [p for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts]
    packs = cpu_quant.packs(parts[0].type_id, parts[0].cols)
    assert parts and all(p.packed == packs for p in parts)
    for p in (*parts, model.embed_tokens.weight_q) if packs else ():
        assert "hg" in _mapping(p.data.data_ptr())[1] or not THP.exists()


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
