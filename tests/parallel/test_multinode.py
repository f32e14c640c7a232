"""Two "nodes" on 127.0.0.1 (gloo), each its own process tree: `pagedserve serve --nnodes 2
--node-rank 0` (gateway, engine, rank 0) and `pagedserve serve --headless --node-rank 1` (rank 1
only) give one rank's greedy tokens; a headless node exits when the engine dies; the
multi-node flags are validated naming the field.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ipc import exit_codes
from ipc.config import EngineConfig
from ipc.sampling import SamplingParams
from tests.e2e.serve_support import ROOT, free_port, wait_health

pytestmark = pytest.mark.timeout(240)
PROMPTS = [[1, 5, 9, 33, 100, 7, 8], list(range(10, 60))]
MAX_TOKENS = 8


def _tp_flags(model: Path, port: int, node_rank: int) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--num-threads", "1",
            "--num-gpu-blocks", "64", "--max-model-len", "256", "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port)]


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def test_two_nodes_give_one_ranks_greedy_tokens(tiny_model_dir: Path) -> None:
    from engine.llm import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", num_gpu_blocks=64, max_model_len=256,
              num_threads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    one_rank = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    del llm

    master, http = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    leader = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(http),
         "--shutdown-timeout", "5", *_tp_flags(tiny_model_dir, master, 0)],
        cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen(  # NOTE: its own session: a separate process tree, as a node
        [sys.executable, "-m", "gateway.cli", "serve", "--headless",
         *_tp_flags(tiny_model_dir, master, 1)],
        cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{http}"
        wait_health(url, 200, 180)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for prompt, ref in zip(PROMPTS, one_rank, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "logprobs": 0}
            choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()[
                "choices"][0]
            assert choice["text"] == ref.text
            served = choice["logprobs"]["token_logprobs"]
            expected = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
            assert served == pytest.approx(expected, abs=1e-3)
    finally:
        assert _stop(leader) == 0
        # NOTE: the leader's engine stops its ranks on the way out: the headless node ends
        # by itself, cleanly
        code = worker.wait(30)
        err = worker.stderr.read().decode() if worker.stderr else ""
        assert code == 0, err[-2000:]


@pytest.mark.parametrize(("options", "field"), [
    (dict(nnodes=2, tensor_parallel_size=2), "master_port"),
    (dict(nnodes=2, tensor_parallel_size=3, master_port=29500), "tensor_parallel_size"),
    (dict(nnodes=2, node_rank=2, tensor_parallel_size=2, master_port=29500), "node_rank"),
    (dict(nnodes=0), "nnodes"),
    (dict(master_port=70000), "master_port"),
])
def test_multinode_fields_are_validated(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)


@pytest.mark.parametrize(("flags", "message"), [
    (["--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2",
      "--master-port", "29500"], "--headless"),
    (["--headless", "--nnodes", "2", "--tensor-parallel-size", "2", "--master-port", "29500"],
     "node_rank"),
    (["--nnodes", "2", "--tensor-parallel-size", "2", "--master-port", "29500",
      "--data-parallel-size", "2"], "--data-parallel-size"),
])
def test_serve_refuses_node_flags_that_cannot_work(flags: list[str], message: str) -> None:
    from gateway.cli import build_parser, check_args

    ns = build_parser().parse_args(["serve", *flags])
    with pytest.raises(ValueError, match=message):
        check_args(ns)


def test_flags_reach_a_spawned_engine() -> None:
    config = EngineConfig(tensor_parallel_size=4, nnodes=2, master_addr="10.0.0.1",
                          master_port=29500)
    from engine.parallel.group import Topology

    assert Topology.from_config(config.replace(node_rank=1)).local_ranks == range(2, 4)
    assert config.to_cli_args() == ["--tensor-parallel-size", "4", "--nnodes", "2",
                                    "--master-addr", "10.0.0.1", "--master-port", "29500"]


def test_a_headless_node_exits_when_the_engine_dies(tiny_model_dir: Path) -> None:
    master = free_port()
    flags = _tp_flags(tiny_model_dir, master, 1)
    leader = subprocess.Popen(  # node 0 as a bare engine: LLM, killed once its ranks joined
        [sys.executable, "-c", "import sys, time\nfrom engine.llm import LLM\n"
         f"LLM({str(tiny_model_dir)!r}, device='cpu', num_gpu_blocks=64, max_model_len=256, "
         f"num_threads=1, tensor_parallel_size=2, nnodes=2, master_port={master})\n"
         "print('ready', flush=True)\ntime.sleep(120)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, start_new_session=True)
    worker = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--headless", *flags],
                              cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        assert leader.stdout is not None and leader.stdout.readline() == b"ready\n"
        os.kill(leader.pid, signal.SIGKILL)
        assert worker.wait(60) == exit_codes.ENGINE_DIED  # its ranks saw the sockets close
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
