"""bench.offline smoke run on the tiny model: both systems, every figure present (no timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import offline


@pytest.mark.parametrize("distribution", ["mixed"])
def test_offline_smoke(tiny_model_dir: Path, capsys, distribution: str) -> None:
    offline.main(["--model", str(tiny_model_dir), "--num-gpu-blocks", "64", "--max-model-len",
                  "512", "--distribution", distribution, "--num-requests", "4",
                  "--max-output-len", "6", "--baseline-batch-sizes", "2,4",
                  "--dollars-per-hour", "2.0", "--json"])
    result = json.loads(capsys.readouterr().out)
    engine = result["pagedserve"]
    assert engine["output_tokens"] == sum(  # ignore_eos: exactly the requested tokens
        b["output_tokens"] for b in result["baselines"][:1])
    assert [b["batch_size"] for b in result["baselines"]] == [2, 4]
    assert result["best_baseline_batch_size"] in (2, 4)
    for r in [engine, *result["baselines"]]:
        assert r["output_tok_per_s"] > 0 and r["total_tok_per_s"] > r["output_tok_per_s"]
        assert r["peak_rss_bytes"] > 0 and r["ratio_to_baseline"] > 0
        assert r["dollars_per_million_output_tokens"] == pytest.approx(
            2.0 / 3600 / r["output_tok_per_s"] * 1e6)
    floor = engine["floor"]
    assert 0 < floor["fraction_of_floor"] < floor["fraction_of_floor_all_tokens"]


@pytest.mark.parametrize("num_requests", [1, 2])
def test_offline_breakdown_without_baseline(tiny_model_dir: Path, capsys,
                                            num_requests: int) -> None:
    """One request too: the warm-up takes as many prompts as there are."""
    offline.main(["--model", str(tiny_model_dir), "--num-gpu-blocks", "64", "--max-model-len",
                  "512", "--num-requests", str(num_requests), "--output-len", "4",
                  "--prompt-len", "8", "--baseline", "none", "--breakdown"])
    out = capsys.readouterr().out
    assert "pagedserve" in out and "model forward" in out and "hf-static" not in out


def test_step_overhead_drives_the_scheduler_to_completion():
    from bench.step_overhead import measure

    r = measure(num_requests=4, prompt_len=20, output_len=5)
    # 20-token prompts fit one step, then 4 more decode steps (the first token comes with it)
    assert r["steps"] == 5
