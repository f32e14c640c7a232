"""The README stays true: it shows the two commands first and names every engine option."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ipc.config import EngineConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_two_commands_come_first():
    first_block = README.split("```sh", 1)[1].split("```", 1)[0]
    assert "make serve" in first_block and "make test" in first_block


def test_every_engine_option_is_documented():
    for f in fields(EngineConfig):
        assert f"`{f.name}`" in README, f"README does not document the engine option {f.name}"
