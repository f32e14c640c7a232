"""A test double of EngineCore, and `python fake_engine.py` = `python -m engine` on it (no torch).

Env knobs for the subprocess: FAKE_STEP_DELAY (seconds per step), FAKE_FAIL_AT_STEP.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: run as a script

from engine.__main__ import main  # noqa: E402
from ipc.config import EngineConfig  # noqa: E402
from ipc.messages import AddRequest, EngineStats, TokenDelta  # noqa: E402


class FakeCore:
    """Obeys EngineCore's interface (engine.process.Core): one token per running request per
    step; no swap pool, no prefix cache, one choice per request."""

    model_name = "fake"
    max_model_len = 64
    block_size = 16
    num_gpu_blocks = 8
    num_cpu_blocks = 0
    eos_token_ids = [0]
    tokenizer_dir = "/nonexistent/tokenizer"
    max_num_seqs = 0  # not reported
    max_logprobs = EngineConfig.max_logprobs
    pooling_info = None  # generates only

    def __init__(self, *, fail_at_step: int | None = None, step_delay: float = 0.0) -> None:
        self.remaining: dict[str, int] = {}
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.step_delay = step_delay

    def add_request(self, msg: AddRequest) -> None:
        if not msg.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(msg.prompt_token_ids) > self.max_model_len:
            raise ValueError("prompt is too long")
        self.remaining[msg.request_id] = msg.sampling.max_tokens or self.max_model_len

    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        live = [r for r in request_ids if self.remaining.pop(r, None) is not None]
        return [TokenDelta(request_id=r, finish_reason="abort") for r in live]

    def abort_choice(self, request_id: str, index: int) -> list[TokenDelta]:
        return self.abort_requests([request_id]) if index == 0 else []

    def cached_block_hashes(self) -> list[bytes]:
        return []

    def load_lora(self, name: str, path: str) -> list[str]:
        raise ValueError("LoRA is off: start the engine with --enable-lora")  # as EngineCore's

    def unload_lora(self, name: str) -> list[str]:
        raise ValueError("LoRA is off: start the engine with --enable-lora")

    def step(self) -> list[TokenDelta]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("kernel exploded")
        time.sleep(self.step_delay)
        deltas = []
        for rid in list(self.remaining):
            self.remaining[rid] -= 1
            done = self.remaining[rid] == 0
            if done:
                del self.remaining[rid]
            deltas.append(TokenDelta(request_id=rid, new_token_ids=[self.steps],
                                     finish_reason="length" if done else None))
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def stats(self) -> EngineStats:
        return EngineStats(step=self.steps, num_running=len(self.remaining),
                           kv_blocks_total=self.num_gpu_blocks)


def _from_env() -> FakeCore:
    fail = os.environ.get("FAKE_FAIL_AT_STEP")
    return FakeCore(step_delay=float(os.environ.get("FAKE_STEP_DELAY", "0.01")),
                    fail_at_step=int(fail) if fail else None)


if __name__ == "__main__":
    sys.exit(main(core_factory=lambda _config: _from_env()))
