"""bench/peers.py's pieces that need no server: process-tree RSS and the ratio table."""

from __future__ import annotations

import os
import subprocess
import sys

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
         "engine_rss_ready_bytes": 2**29},
        {"server": "float32", "points": [_point(1, 30.0), _point(8, 100.0)],
         "time_to_ready_s": 3.0, "rss_ready_bytes": 2**30, "rss_peak_bytes": 2**30},
        {"server": "llama.cpp", "points": [_point(1, 40.0), _point(8, 50.0)],
         "time_to_ready_s": 1.0, "rss_ready_bytes": None, "rss_peak_bytes": None},
    ]
    text = "\n".join(peers.ratio_table(results))
    assert "| quantized | 1 | 60.0 | 10.0 | 1.50x tok/s | 2.00x tok/s |" in text
    assert "| quantized | 8 | 300.0 | 10.0 | 6.00x tok/s | 3.00x tok/s |" in text
    assert "| quantized | 2.0 | 1024 | 512 | 2048 |" in text  # engine RSS: its own column
    assert "| float32 | 3.0 | 1024 | - | 1024 |" in text  # a result without it says "-"
    assert "| llama.cpp | 1.0 | - | - |" in text
