"""bench.long_prefill on the tiny model: the long prompt's steps follow the chunk cap while
streams decode beside it (no timings): 300 tokens in 128-token chunks (the CPU default) take
3 steps; with the cap off, 1 (the 512-token budget holds them and the streams' two); with a
cap of 50 (and a budget of 200), 6."""

from __future__ import annotations

from pathlib import Path

from bench import long_prefill


def test_the_long_prompt_is_chunked_only_as_the_cap_says(tiny_model_dir: Path) -> None:
    result = long_prefill.main([
        "--model", str(tiny_model_dir), "--streams", "2", "--long-len", "300", "--rounds", "1",
        "--configs", "default;max_prefill_tokens_while_decoding=0;"
                     "max_prefill_tokens_while_decoding=50,max_num_batched_tokens=200"])
    steps = {c: s["steps_during"] for c, s in result["configs"].items()}
    assert steps == {"default": 3, "max_prefill_tokens_while_decoding=0": 1,
                     "max_prefill_tokens_while_decoding=50,max_num_batched_tokens=200": 6}
    for s in result["configs"].values():
        assert 0 < s["itl_during_p50_ms"] <= s["itl_during_p99_ms"] <= s["itl_during_max_ms"]
        assert s["long_ttft_s"] > 0
