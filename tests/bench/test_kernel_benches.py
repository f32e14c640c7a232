"""Smoke runs of the kernel benchmarks: paged vs contiguous decode, and the CPU linear modes."""

from __future__ import annotations

import torch

from bench import attention, cpu_linear
from engine.models.cpu_linear import mkl_packed_available


def test_attention_bench_prints_every_case(capsys) -> None:
    attention.main(["--iters", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["1", "512"], ["1", "4096"], ["8", "1024"], ["32", "512"],
                                     ["64", "256"]]
    assert all(float(r[-3]) > 0 for r in rows)  # torch/contig measured
    assert all(float(r[-1]) > 0 for r in rows)  # cpu over cpu-f16 (the float16 cache)


def test_cpu_linear_bench_times_all_modes(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        cpu_linear.main(["--rows", "1,4", "--iters", "1", "--num-threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the flag sets it for the whole process
    out = capsys.readouterr().out.splitlines()
    assert "121 linear products per step" in out[0]
    modes = out[1].split("speedup over torch:")[0].split()[1:]
    assert modes[:3] == ["torch", "onednn", "dense+onednn"]
    assert modes[3:] == (["dual"] if mkl_packed_available() else [])
    assert [line.split()[0] for line in out[2:]] == ["1", "4"]
    # rows, then ms per mode, then the speedup of each mode but torch
    assert all(len(line.split()) == 2 * len(modes) for line in out[2:])
