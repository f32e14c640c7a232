"""systemd/ units: `systemd-analyze verify` when it is installed, and always a parse of the
units and the EnvironmentFile example, with each ExecStart run through the real flag parsers."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).parents[2] / "systemd"
UNITS = ("pagedserve-gateway.service", "pagedserve-engine@.service")
HARDENING = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
             "RuntimeDirectory=pagedserve", "RuntimeDirectoryPreserve=yes")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), with `\\` line continuations joined."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"bad line {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def env_file() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (SYSTEMD / "pagedserve.env").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def exec_argv(unit: str) -> list[str]:
    """ExecStart with the example EnvironmentFile substituted the way systemd does it."""
    env = env_file()
    line = parse_unit((SYSTEMD / unit).read_text())["Service"]["ExecStart"][0]
    line = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(env[m.group(1)]), line)
    line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)  # NOTE: $VAR splits on spaces
    return shlex.split(line)


@pytest.mark.parametrize("unit", UNITS)
def test_unit_has_notify_restart_and_hardening(unit: str) -> None:
    service = parse_unit((SYSTEMD / unit).read_text())["Service"]
    flat = {f"{k}={v}" for k, values in service.items() for v in values}
    assert {"Type=notify", "Restart=on-failure", "RestartPreventExitStatus=2"} <= flat
    assert set(HARDENING) <= flat
    assert int(service["WatchdogSec"][0]) > 0
    drain = float(env_file()["PAGEDSERVE_SHUTDOWN_TIMEOUT"])
    assert int(service["TimeoutStopSec"][0]) >= drain + 15, "stop timeout above the drain"
    assert service["EnvironmentFile"][0] == "/etc/pagedserve/pagedserve.env"


def test_engine_keeps_gpus_and_gateway_has_none() -> None:
    engine = parse_unit((SYSTEMD / UNITS[1]).read_text())["Service"]
    gateway = parse_unit((SYSTEMD / UNITS[0]).read_text())["Service"]
    assert "PrivateDevices" not in engine
    assert any("nvidia" in d for d in engine["DeviceAllow"])
    assert gateway["PrivateDevices"] == ["yes"]
    assert "AF_UNIX" in gateway["RestrictAddressFamilies"][0]


def test_gateway_exec_start_parses_and_attaches(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import build_parser, check_args

    for key, value in env_file().items():
        monkeypatch.setenv(key, value)
    argv = exec_argv(UNITS[0])
    assert argv[1] == "serve"
    ns = build_parser().parse_args(argv[1:])
    check_args(ns)
    assert ns.attach_engine and ns.engine_input_addr == env_file()["PAGEDSERVE_ENGINE_INPUT"]
    assert ns.shutdown_timeout == float(env_file()["PAGEDSERVE_SHUTDOWN_TIMEOUT"])


def test_engine_exec_start_parses_and_uses_the_gateway_sockets() -> None:
    from engine.__main__ import build_parser

    argv = exec_argv(UNITS[1])
    assert argv[1] == "engine"
    ns = build_parser().parse_args(argv[2:])
    env = env_file()
    assert (ns.input_addr, ns.output_addr) == (env["PAGEDSERVE_ENGINE_INPUT"],
                                               env["PAGEDSERVE_ENGINE_OUTPUT"])
    assert ns.input_addr.startswith("ipc:///run/pagedserve/")  # the shared RuntimeDirectory


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    for unit in UNITS:
        text = (SYSTEMD / unit).read_text()
        # NOTE: verify checks that ExecStart's binary exists; the install path does not here.
        text = text.replace("/opt/pagedserve/.venv/bin/pagedserve", "/bin/true")
        (tmp_path / unit.replace("@.", "@0.")).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *sorted(str(p) for p in tmp_path.iterdir())],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), (
        result.stdout + result.stderr)
