"""Shared fixtures: the bundled model's files, and tiny random-weight Llama models."""

from __future__ import annotations

import os
from pathlib import Path


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`make test` runs two workers), worker N keeps CPU N to itself before
    torch or OpenMP read the CPU count: every process it starts inherits the one CPU, so two
    workers never fight over both cores with spinning OpenMP threads."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cpus = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_pin_xdist_worker()  # NOTE: before torch loads: libgomp reads the CPU mask when it loads

import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from tiny_llama import build_tiny_llama  # noqa: E402


@pytest.fixture
def short_tmp_dir() -> Iterator[Path]:
    """A fresh directory under /tmp for socket files: pytest's tmp_path (longer under xdist's
    popen-gwN/) can leave a Unix socket's 107-byte path no room (ipc.transport.IPC_PATH_MAX)."""
    path = Path(tempfile.mkdtemp(prefix="ps-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def bundled_tokenizer_dir() -> Path:
    """Tokenizer files of the bundled model (exported from its GGUF once, then cached)."""
    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    return tokenizer_dir(resolve_model(None))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_tokenizer_dir) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads) and the bundled tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_tokenizer_dir)


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory, bundled_tokenizer_dir) -> Path:
    """The tiny Llama with widths that are multiples of 256, for the K-quants' super-blocks."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-wide"), bundled_tokenizer_dir,
                            hidden_size=256, intermediate_size=512)
