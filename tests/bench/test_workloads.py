"""bench.workloads: seeded, and each named distribution draws what it says."""

from __future__ import annotations

import pytest

from bench.workloads import (
    CHAT_TABLE,
    MIXED_LONG,
    MIXED_PROMPT,
    MIXED_SHORT,
    RequestSpec,
    chat_table,
    make_workload,
)


@pytest.mark.parametrize("name", ["fixed", "mixed", "chat"])
def test_seeded(name: str) -> None:
    assert make_workload(name, 50, seed=3) == make_workload(name, 50, seed=3)
    assert len(make_workload(name, 50, seed=3)) == 50


@pytest.mark.parametrize("name", ["mixed", "chat"])
def test_seed_changes_draw(name: str) -> None:
    assert make_workload(name, 50, seed=1) != make_workload(name, 50, seed=2)


def test_fixed_is_128_128() -> None:
    assert set(make_workload("fixed", 20)) == {RequestSpec(128, 128)}


def test_mixed_interleaves_short_and_long() -> None:
    specs = make_workload("mixed", 400, seed=0)
    short, long = specs[0::2], specs[1::2]
    assert all(MIXED_SHORT[0] <= s.output_len <= MIXED_SHORT[1] for s in short)
    assert all(MIXED_LONG[0] <= s.output_len <= MIXED_LONG[1] for s in long)
    assert all(MIXED_PROMPT[0] <= s.prompt_len <= MIXED_PROMPT[1] for s in specs)
    # NOTE: uniform draws: 200 samples reach close to both ends of each range.
    assert min(s.output_len for s in long) < 400 and max(s.output_len for s in long) > 1800
    assert min(s.output_len for s in short) < 25 and max(s.output_len for s in short) > 85


def test_chat_draws_rows_of_the_table() -> None:
    table = chat_table()
    assert len(table) >= 50 and CHAT_TABLE.name == "chat_lengths.csv"
    specs = make_workload("chat", 500, seed=0)
    assert set(specs) <= set(table)
    assert len(set(specs)) > len(set(table)) // 2  # draws spread over the table


def test_clipping() -> None:
    specs = make_workload("mixed", 100, seed=0, max_output_len=300, max_total_len=400)
    assert all(s.output_len <= 300 and s.prompt_len + s.output_len <= 400 for s in specs)
    assert all(s.prompt_len >= 1 for s in specs)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="distribution"):
        make_workload("zipf", 4)
    with pytest.raises(ValueError, match="n must"):
        make_workload("fixed", 0)
