"""Every file the runtime packages need besides Python is declared as package data, so a
non-editable install (`pip install ./pagedserve`, as docs/operations.md does) carries it."""

from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("gateway", "engine", "ipc", "kernels")


def test_non_python_files_are_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    tracked = subprocess.run(["git", "ls-files", *RUNTIME], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    missing = []
    for path in tracked:
        package, _, rest = path.partition("/")
        if path.endswith(".py"):
            continue
        if not any(fnmatch.fnmatch(rest, pattern) for pattern in data.get(package, [])):
            missing.append(path)
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
    assert "kernels/cpu/csrc/decode.c" in tracked
