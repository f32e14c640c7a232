"""A benchmark's result as a JSON file (`--out`), its folder made first."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path | None, result: object, indent: int = 1) -> None:
    """Write `result` to `path`; nothing when no path was given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent))
