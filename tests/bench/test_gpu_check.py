"""bench.gpu_check's steps on --device cpu with tiny sizes (CI has no GPU): kernel tests, greedy
parity against HF transformers, `pagedserve serve` with one openai-client stream, throughput;
on a machine without CUDA every step of --device cuda reports skipped, none crashes; a backend
that should exist and does not import fails the kernels step; GPU-vs-CPU divergences that are
not near-ties fail parity.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import gpu_check

pytestmark = pytest.mark.timeout(120)


def _table(out: str) -> dict[str, tuple[str, str]]:
    rows = re.findall(r"^\| (\w+) +\| (ok|FAIL|skipped) +\| +[\d.]+ \| (.*?) *\|$", out, re.M)
    return {step: (status, detail) for step, status, detail in rows}


def test_every_step_on_cpu(tiny_model_dir: Path, capsys) -> None:
    status = gpu_check.main([
        "--device", "cpu", "--model", str(tiny_model_dir), "--parity-prompts", "2",
        "--max-new", "6", "--batch-sizes", "1,2", "--prompt-len", "8", "--output-len", "4",
        "--num-gpu-blocks", "64"])
    table = _table(capsys.readouterr().out)
    assert status == 0, table
    assert table["kernels"][0] == "ok" and " 0 failed" in table["kernels"][1]
    assert table["parity"] == ("ok", "torch, float32; vs HF on cpu: 2/2 sequences equal")
    assert table["serve"][0] == "ok" and "streamed" in table["serve"][1]
    assert table["throughput"][0] == "ok" and "B=1:" in table["throughput"][1] \
        and "B=2:" in table["throughput"][1]
    assert table["attention"][0] == "skipped"


def test_without_a_gpu_every_cuda_step_is_skipped(capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 0
    table = _table(capsys.readouterr().out)
    assert set(table) == {"kernels", "parity", "serve", "throughput", "attention"}
    assert all(status == "skipped" and "CUDA" in detail for status, detail in table.values())


def test_a_divergence_from_hf_that_is_not_a_near_tie_fails() -> None:
    import torch

    logprobs = [[torch.tensor([-0.1, -5.0, -0.1005])] * 2]
    assert gpu_check._real_divergences([[0, 1]], [[0, 0]], logprobs) == [
        "prompt 0 token 1 (HF log-prob gap 4.9)"]
    assert gpu_check._real_divergences([[0, 2]], [[0, 0]], logprobs) == []  # a near-tie


def test_a_spent_budget_skips_the_remaining_steps(capsys) -> None:
    assert gpu_check.main(["--device", "cpu", "--budget", "0"]) == 0
    table = _table(capsys.readouterr().out)
    assert {s for s, _ in table.values()} == {"skipped"}
    assert all("budget is spent" in detail for _, detail in table.values())


def test_a_backend_that_should_exist_and_does_not_import_fails(monkeypatch) -> None:
    import argparse

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name: None if name == "flash_attn" else object())
    assert gpu_check.expected_backends("cuda") == (["torch", "triton"], ["flash_attn"])
    seen: list[list[str]] = []

    def kernel_cases(cmd: list[str], timeout: float) -> str:
        seen.append(cmd)
        return ("torch: done in 1.0s\nskip triton: attention backend 'triton' cannot be used "
                "here: No module named 'triton'\n40 passed, 0 failed\n")

    monkeypatch.setattr(gpu_check, "_subprocess", kernel_cases)
    args = argparse.Namespace(device="cuda", step_timeout=10.0, deadline=1e18)
    with pytest.raises(AssertionError, match="triton"):
        gpu_check.step_kernels(args)
    assert seen[0][seen[0].index("--backends") + 1] == "torch,triton"  # flash_attn not tried
    row = gpu_check._run_step("kernels", gpu_check.step_kernels, args)
    assert row.status == "FAIL" and "triton" in row.detail


def test_a_gpu_cpu_divergence_that_is_not_a_near_tie_fails() -> None:
    import torch

    logprobs = [[torch.tensor([-0.1, -5.0, -0.1005])] * 2]
    hf = [[0, 0]]
    assert gpu_check.cpu_divergences([[0, 0]], [[0, 1]], hf, logprobs) == [
        "prompt 0 token 1 (HF log-prob gap 4.9)"]
    assert gpu_check.cpu_divergences([[0, 0]], [[0, 2]], hf, logprobs) == []  # a near-tie
    assert gpu_check.cpu_divergences([[0, 0]], [[0, 0, 1]], hf, logprobs) == [
        "prompt 0: 2 tokens, CPU 3"]
    # the device left HF's output first (a near-tie, judged against HF): not judged again
    assert gpu_check.cpu_divergences([[2, 0]], [[2, 1]], hf, logprobs) == []
