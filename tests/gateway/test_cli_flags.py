"""`pagedserve serve` refuses a flag value it cannot honour before it starts anything: exit 2
naming the flag, never a silent change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_port_out_of_range_exits_2_naming_the_flag(port: str) -> None:
    # NOTE: the socket layer takes a port modulo 65536: 99999 would listen on 34463
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", port],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--port" in r.stderr and port in r.stderr


def test_serve_help_states_each_default_once_and_never_none() -> None:
    from gateway.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions).choices["serve"]  # type: ignore[union-attr]
    for action in serve._actions:
        if not action.help:
            continue
        text = serve._get_formatter()._expand_help(action)
        assert "(default: None)" not in text, (action.option_strings, text)
        # NOTE: a help that says its default in words gets no "(default: ...)" beside it
        assert text.lower().count("default") <= 1, (action.option_strings, text)
