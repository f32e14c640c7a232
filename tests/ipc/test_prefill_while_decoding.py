"""max_prefill_tokens_while_decoding: its per-device default, 0 for no cap, a negative value
refused naming the field, and the flag carried from `serve` to the engine process's argv."""

from __future__ import annotations

import argparse

import pytest

from ipc.config import (
    EngineConfig,
    add_engine_args,
    config_from_args,
    prefill_tokens_while_decoding,
)


def test_the_default_caps_on_the_cpu_only():
    assert prefill_tokens_while_decoding(EngineConfig(), "cpu") == 128
    assert prefill_tokens_while_decoding(EngineConfig(), "cuda") is None
    assert prefill_tokens_while_decoding(
        EngineConfig(max_prefill_tokens_while_decoding=0), "cpu") is None
    assert prefill_tokens_while_decoding(
        EngineConfig(max_prefill_tokens_while_decoding=32), "cuda") == 32


def test_a_negative_cap_is_refused():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 0"):
        EngineConfig(max_prefill_tokens_while_decoding=-1)


def test_the_flag_reaches_the_engine_argv():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = config_from_args(parser.parse_args(["--max-prefill-tokens-while-decoding", "64"]))
    assert cfg.max_prefill_tokens_while_decoding == 64
    again = config_from_args(parser.parse_args(cfg.to_cli_args()))
    assert again.max_prefill_tokens_while_decoding == 64
