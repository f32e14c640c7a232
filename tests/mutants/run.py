"""Runs the mutant catalogue (every tests/mutants/*.toml): each mutant, alone, in a scratch
copy of the tree, against only its test files; prints `killed` with the first failing test, or
SURVIVED. `make mutants` runs it all (never in CI: too slow); `--only ID` picks mutants.

NOTE: mutmut, cosmic-ray and pytest-gremlins generate their own mutants by operator; none runs a
fixed list of exact text replacements against chosen test files, which is what a catalogue of
the breaks users would notice needs. This runner is that and no more.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = Path(__file__).parent  # one .toml file per feature area


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    old: str  # the exact text replaced: it must occur once in `file`
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that must catch it
    why: str = ""  # the break a user would notice
    equivalent: str = ""  # set: the mutant cannot be caught, and why (not run)


def load(folder: Path = CATALOGUE) -> list[Mutant]:
    entries = [e for path in sorted(folder.glob("*.toml"))
               for e in tomllib.loads(path.read_text())["mutant"]]
    mutants = [Mutant(**{**e, "tests": tuple(e["tests"])}) for e in entries]
    ids = [m.id for m in mutants]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise ValueError(f"mutant ids used twice: {sorted(dupes)}")
    return mutants


def problems(m: Mutant, root: Path = ROOT) -> list[str]:
    """What makes a catalogue entry stale: its text gone or repeated, a test file missing."""
    found = []
    target = root / m.file
    if not target.is_file():
        return [f"{m.id}: {m.file} does not exist"]
    count = target.read_text().count(m.old)
    if count != 1:
        found.append(f"{m.id}: its text occurs {count} times in {m.file} (must be once)")
    if m.old == m.new:
        found.append(f"{m.id}: the replacement is the text itself")
    for t in m.tests:
        if not (root / t.split("::")[0]).is_file():
            found.append(f"{m.id}: test file {t} does not exist")
    return found


def scratch_copy() -> Path:
    """The tree as it is now (tracked and untracked files, ignored ones left out)."""
    dest = Path(tempfile.mkdtemp(prefix="mutants-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    return dest


def run_one(m: Mutant, tree: Path, timeout: float) -> tuple[str, str, float]:
    """(verdict, detail, seconds): killed (by which test) or SURVIVED."""
    target = tree / m.file
    original = target.read_text()
    target.write_text(original.replace(m.old, m.new, 1))
    started = time.monotonic()
    try:
        # NOTE: the copy shadows the editable install: cwd and PYTHONPATH come first
        env = {**os.environ, "PYTHONPATH": str(tree)}
        workers = ["-n", "2", "--dist", "loadfile"] if len(m.tests) > 1 else []
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider",
             *workers, *m.tests], cwd=tree, env=env, capture_output=True, text=True,
            timeout=timeout)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        return "killed", f"timed out after {timeout:.0f} s", time.monotonic() - started
    finally:
        target.write_text(original)
    seconds = time.monotonic() - started
    if proc.returncode == 0:
        return "SURVIVED", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if proc.returncode in (1, 2) and failed:
        return "killed", failed[0], seconds
    return "killed", f"pytest exit {proc.returncode}: {out.strip().splitlines()[-1:]}", seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", action="append", default=[], help="a mutant id (repeatable)")
    ap.add_argument("--file", help="only the mutants of this source file")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
    ap.add_argument("--list", action="store_true", help="list the catalogue and exit")
    args = ap.parse_args(argv)
    mutants = [m for m in load() if (not args.only or m.id in args.only)
               and (args.file is None or m.file == args.file)]
    stale = [p for m in mutants for p in problems(m)]
    if stale:
        print("\n".join(stale), file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.id}\t{m.file}\t{' '.join(m.tests)}")
        return 0
    tree = scratch_copy()
    survived = 0
    try:
        for m in mutants:
            if m.equivalent:
                print(f"{m.id}: equivalent ({m.equivalent})", flush=True)
                continue
            verdict, detail, seconds = run_one(m, tree, args.timeout)
            survived += verdict == "SURVIVED"
            print(f"{m.id}: {verdict} {detail} ({seconds:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    print(f"{len(mutants) - survived} killed or equivalent, {survived} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
