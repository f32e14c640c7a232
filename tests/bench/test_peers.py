"""bench/peers.py's pieces that need no server: process-tree RSS and the ratio table."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from bench import peers


def test_tree_rss_counts_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        own = int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        assert peers.tree_rss(os.getpid()) > own  # the child's pages are added
    finally:
        child.kill()
        child.wait()


def _point(conc: int, tok_s: float) -> dict:
    return {"concurrency": conc, "output_tokens_per_s": tok_s, "itl_s": {"p50": 0.01}}


def test_ratio_table_divides_by_the_peers_of_the_same_run() -> None:
    results = [
        {"server": "quantized", "points": [_point(1, 60.0), _point(8, 300.0)],
         "time_to_ready_s": 2.0, "rss_ready_bytes": 2**30, "rss_peak_bytes": 2**31,
         "engine_rss_ready_bytes": 2**29, "engine_rss_peak_bytes": 3 * 2**28},
        {"server": "float32", "points": [_point(1, 30.0), _point(8, 100.0)],
         "time_to_ready_s": 3.0, "rss_ready_bytes": 2**30, "rss_peak_bytes": 2**30},
        {"server": "llama.cpp", "points": [_point(1, 40.0), _point(8, 50.0)],
         "time_to_ready_s": 1.0, "rss_ready_bytes": 2**28, "rss_peak_bytes": 2**29,
         "engine_rss_ready_bytes": 2**28, "engine_rss_peak_bytes": 2**29},
    ]
    text = "\n".join(peers.ratio_table(results))
    assert "| quantized | 1 | 60.0 | 10.0 | 1.50x tok/s | 2.00x tok/s |" in text
    assert "| quantized | 8 | 300.0 | 10.0 | 6.00x tok/s | 3.00x tok/s |" in text
    # engine RSS at ready and peak: their own columns, and ratios against llama.cpp's
    assert "| quantized | 2.0 | 1024 | 512 | 2048 | 768 | 2.00x / 1.50x |" in text
    assert "| float32 | 3.0 | 1024 | - | 1024 | - | - / - |" in text  # without it: "-"
    assert "| llama.cpp | 1.0 | 256 | 256 | 512 | 512 | 1.00x / 1.00x |" in text


def test_kv_match_gives_pagedserve_llama_cpps_context_in_float16() -> None:
    assert peers.kv_match_args(4096) == ["--num-gpu-blocks", "256", "--block-size", "16",
                                         "--kv-cache-dtype", "float16", "--swap-space", "0"]
    assert peers.kv_match_args(4000)[1] == "250" and peers.kv_match_args(4001)[1] == "251"


def test_rss_sampler_tracks_the_engine_process_apart() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m",
                              "engine", "x"])
    try:
        for _ in range(500):  # NOTE: until the child has exec'd (its command line is its own)
            if " -m engine " in open(f"/proc/{child.pid}/cmdline").read().replace("\0", " "):
                break
            time.sleep(0.01)
        sampler = peers.RssSampler(os.getpid())
        sampler.sample()
        engine = peers.engine_rss(peers.process_rss(os.getpid()))
        assert 0 < sampler.engine_peak < sampler.peak  # the child alone, the tree beside it
        assert abs(sampler.engine_peak - engine) < 2**24
    finally:
        child.kill()
        child.wait()


def test_f16kv_kinds_are_their_server_over_a_float16_cache() -> None:
    import argparse

    args = argparse.Namespace(threads=2, kv_match=False, n_ctx=4096, pagedserve_args="")
    plain = peers.server_command("quantized-a8", "m.gguf", 1, args)
    f16 = peers.server_command("quantized-a8-f16kv", "m.gguf", 1, args)
    assert f16 == plain + ["--kv-cache-dtype", "float16"]
    assert "--kv-cache-dtype" not in peers.server_command("float32", "m.gguf", 1, args)
    exact = peers.server_command("quantized-a32", "m.gguf", 1, args)
    assert exact[exact.index("--quantization-numerics") + 1] == "a32"
    assert "--quantization-numerics" not in peers.server_command("quantized", "m.gguf", 1, args)


def _server_args(**over: object) -> argparse.Namespace:
    base = dict(threads=2, kv_match=False, n_ctx=4096, pagedserve_args="", slots=64,
                slot_ctx=512, kv_unified=False, llama_server="/opt/llama-server",
                llama_server_amx=False)
    return argparse.Namespace(**(base | over))


def test_llama_server_runs_64_slots_of_continuous_batching_on_the_threads() -> None:
    cmd = peers.server_command("llama-server", "m.gguf", 8123, _server_args())
    assert cmd[:3] == ["/opt/llama-server", "-m", "m.gguf"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--port"] == "8123" and flags["-t"] == "2" and flags["-tb"] == "2"
    assert flags["-np"] == "64" and flags["-c"] == str(64 * 512)  # 512 tokens per slot
    assert "--cont-batching" in cmd and "--kv-unified" not in cmd
    unified = peers.server_command("llama-server", "m.gguf", 1, _server_args(kv_unified=True))
    assert unified[unified.index("-c") + 1] == "4096" and "--kv-unified" in unified


def test_llama_server_default_binary_is_the_cached_build(tmp_path, monkeypatch) -> None:
    from bench import llama_cpp

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m bench.llama_cpp build"):
        peers.server_command("llama-server", "m.gguf", 1, _server_args(llama_server=None))
    exe = tmp_path / "llama.cpp-0.3.36" / "build-noamx" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    cmd = peers.server_command("llama-server", "m.gguf", 1, _server_args(llama_server=None))
    assert cmd[0] == str(exe) == str(llama_cpp.binary("llama-server"))


def test_ratios_are_against_llama_server_when_the_run_has_it() -> None:
    results = [
        {"server": "quantized", "points": [_point(8, 300.0)], "time_to_ready_s": 2.0,
         "rss_ready_bytes": 2**30, "rss_peak_bytes": 2**30, "engine_rss_ready_bytes": 2**29,
         "engine_rss_peak_bytes": 2**29},
        {"server": "llama.cpp", "points": [_point(8, 30.0)], "time_to_ready_s": 1.0,
         "rss_ready_bytes": 2**28, "rss_peak_bytes": 2**28},
        {"server": "llama-server", "points": [_point(8, 100.0)], "time_to_ready_s": 1.0,
         "rss_ready_bytes": 2**28, "rss_peak_bytes": 2**28, "engine_rss_ready_bytes": 2**28,
         "engine_rss_peak_bytes": 2**28},
    ]
    text = "\n".join(peers.ratio_table(results))
    assert "| vs llama-server | vs float32 |" in text
    assert "| quantized | 8 | 300.0 | 10.0 | 3.00x tok/s | - |" in text
    assert "| quantized | 2.0 | 1024 | 512 | 1024 | 512 | 2.00x / 2.00x |" in text


def test_process_cpu_counts_a_busy_child_apart_from_an_idle_one() -> None:
    """The busy child reports its own CPU time (time.process_time, an independent clock)."""
    busy = ("import sys, time\n"
            "while time.process_time() < 0.4: pass\n"
            "print(time.process_time(), flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        own = float(child.stdout.readline())
        cpu = peers.process_cpu(os.getpid())
        by_pid = {int(k.split()[0]): v for k, v in cpu.items()}
        assert by_pid[child.pid] == pytest.approx(own, abs=0.05)
        assert by_pid[idle.pid] < 0.2  # the interpreter's start, no loop
    finally:
        child.kill(), idle.kill()
        child.wait(), idle.wait()


def test_cpu_per_token_divides_each_process_and_the_client_by_the_tokens() -> None:
    before = {"1 python -m gateway.cli serve": 1.0, "2 python -m engine --model": 5.0,
              "3 gone": 0.5}
    after = {"1 python -m gateway.cli serve": 1.5, "2 python -m engine --model": 7.0}
    per = peers.cpu_per_token(before, after, client=0.25, tokens=500)
    assert per == pytest.approx({"1 python -m gateway.cli serve": 1.0,
                                 "2 python -m engine --model": 4.0, "client": 0.5})
    assert [peers._short(k) for k in per] == ["gateway", "engine", "client"]
    assert peers.cpu_per_token(before, after, client=0.25, tokens=0) == {}
