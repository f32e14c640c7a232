"""Builds a C source of kernels/ into a shared library on first use, cached per source and CPU.

Compiled with the system C compiler (`$CC`, else cc or gcc) and the caller's flags into
`$PAGEDSERVE_CACHE/kernels/` (default ~/.cache/pagedserve), keyed by a hash of the source, the
flags, the compiler's version and the CPU's flags, and loaded with ctypes. Any failure raises
ImportError, so callers treat a missing compiler like a missing optional package.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# NOTE: linked in a second step without -ffast-math: gcc < 13 links crtfastmath.o into a
# -ffast-math shared library, which turns on flush-to-zero for the whole process when loaded.
LINK = ["-shared", "-fopenmp"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(source: Path, flags: list[str]) -> ctypes.CDLL:
    """The library built from `source` with compile `flags` (the cached one when present)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise ImportError(f"{source.name} needs a C compiler (cc or gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([source.read_text(), *flags, *LINK, version, _cpu_flags()])
                             .encode()).hexdigest()[:16]
        root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
        lib = root / "kernels" / f"{source.stem}-{key}.so"
        if not lib.is_file():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                obj, built = Path(tmp) / f"{source.stem}.o", Path(tmp) / lib.name
                for cmd in ([cc, *flags, "-c", str(source), "-o", str(obj)],
                            [cc, *LINK, str(obj), "-o", str(built), "-lm"]):
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode:
                        raise ImportError(
                            f"building {source.name} failed: {done.stderr.strip()[:500]}")
                os.replace(built, lib)  # NOTE: atomic: concurrent builders all end with one file
        return ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache, a bad library
        raise ImportError(f"{source.name} cannot be built here: {e}") from e
