"""Builds C sources into one shared library on first use, cached per sources and CPU.

Each source is compiled with its own flags by the system C compiler (`$CC`, else cc or gcc), the
objects linked into one library in `$PAGEDSERVE_CACHE/kernels/` (default ~/.cache/pagedserve),
keyed by a hash of every source and header, the flags, the compiler's version and the CPU's
flags, and loaded with ctypes. Any failure raises ImportError, so callers treat a missing
compiler like a missing optional package.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# NOTE: linked in a second step without -ffast-math: gcc < 13 links crtfastmath.o into a
# -ffast-math shared library, which turns on flush-to-zero for the whole process when loaded.
LINK = ["-shared", "-fopenmp"]

Source = tuple[Path, Sequence[str]]  # a C file and its compile flags


def cpu_flags() -> str:
    """The CPU's flags line of /proc/cpuinfo (the processor's name where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _key(sources: Sequence[Source], headers: Sequence[Path], version: str) -> str:
    parts = [LINK, version, cpu_flags()]
    for path, flags in sources:
        parts += [path.name, path.read_text(), *flags]
    parts += [text for h in headers for text in (h.name, h.read_text())]
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _compile_and_link(cc: str, name: str, sources: Sequence[Source], built: Path) -> None:
    """Every source to an object (in parallel), then one link; ImportError on a failure."""
    objs = [built.with_name(f"{i}-{path.stem}.o") for i, (path, _) in enumerate(sources)]
    jobs = [subprocess.Popen([cc, *flags, "-c", str(path), "-o", str(obj)], text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for (path, flags), obj in zip(sources, objs, strict=True)]
    errors = [f"{path.name}: {job.communicate()[1].strip()[:500]}"
              for (path, _), job in zip(sources, jobs, strict=True) if job.wait()]
    if errors:
        raise ImportError(f"building {name} failed: {'; '.join(errors)}")
    done = subprocess.run([cc, *LINK, *map(str, objs), "-o", str(built), "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        raise ImportError(f"linking {name} failed: {done.stderr.strip()[:500]}")


def build(name: str, sources: Sequence[Source], headers: Sequence[Path] = ()) -> ctypes.CDLL:
    """The library `name` built from `sources` (the cached one when present); `headers` are
    the files they include, part of the cache key."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise ImportError(f"{name} needs a C compiler (cc or gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
        lib = root / "kernels" / f"{name}-{_key(sources, headers, version)}.so"
        if not lib.is_file():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                built = Path(tmp) / lib.name
                _compile_and_link(cc, name, sources, built)
                os.replace(built, lib)  # NOTE: atomic: concurrent builders all end with one file
        return ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache, a bad library
        raise ImportError(f"{name} cannot be built here: {e}") from e
