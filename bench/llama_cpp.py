"""Builds llama.cpp's own tools (llama-server, llama-bench, llama-perplexity, llama-quantize) from
the tree vendored by the pinned llama-cpp-python sdist, cached outside the repo; never run in CI.

    python -m bench.llama_cpp build [--jobs 2] [--amx auto|on|off]   # prints the binaries' folder
    python -m bench.llama_cpp probe-amx                                # does an AMX tile op run?
    python -m bench.llama_cpp path llama-server                        # one built binary
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ipc import model_source

VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-perplexity", "llama-quantize")
# NOTE: /proc/cpuinfo flag -> ggml's CMake option, for a build without -DGGML_NATIVE (which
# would turn on AMX where the CPU lists it, even where the tile state is not enabled)
CPU_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
               "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
               "avx512_vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
               "avx512_bf16": "GGML_AVX512_BF16"}

# NOTE: the probe does what ggml does before its AMX kernels: ask Linux for the tile data state
# (arch_prctl ARCH_REQ_XCOMP_PERM), then configure tiles and zero one. Where the hypervisor does
# not enable the state, either the request fails or the instruction raises SIGILL.
AMX_PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 3;
    static uint8_t cfg[64]; static int8_t a[16 * 64], b[16 * 64]; static int32_t c[16 * 16];
    cfg[0] = 1;  /* palette 1; tiles 0-2: 16 rows of 64 bytes */
    for (int t = 0; t < 3; t++) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
    memset(a, 1, sizeof a); memset(b, 2, sizeof b);
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);  /* int8 dot products, as ggml's AMX kernels issue them */
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] == 64 * 2 ? 0 : 4;
}
"""


def cache_root() -> Path:
    root = model_source.cache_root()
    return root / f"llama.cpp-{VERSION}"


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def amx_works() -> tuple[bool, str]:
    """Whether an AMX tile instruction runs here (in a child process), and why not."""
    if "amx_tile" not in cpu_flags():
        return False, "the CPU does not list amx_tile"
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return False, "no C compiler for the AMX probe"
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(AMX_PROBE)
        built = subprocess.run([cc, "-O0", "-mamx-tile", "-mamx-int8", str(src), "-o", str(exe)],
                               capture_output=True, text=True)
        if built.returncode:
            return False, f"the AMX probe does not compile: {built.stderr.strip()[:200]}"
        rc = subprocess.run([str(exe)], capture_output=True).returncode
    if rc == 0:
        return True, "an AMX tile instruction ran"
    if rc == 3:
        return False, "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    if rc == 4:
        return False, "AMX tile instructions run but compute a wrong int8 product"
    return False, f"the CPU lists amx_tile but a tile instruction faults (exit {rc})"


def cmake_options(amx: bool, flags: set[str]) -> list[str]:
    """CMake options: a native build where AMX works, else every listed ISA option but AMX."""
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DBUILD_SHARED_LIBS=OFF"]
    if amx:
        return [*common, "-DGGML_NATIVE=ON"]
    isa = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in CPU_OPTIONS.items()]
    return [*common, "-DGGML_NATIVE=OFF", *isa, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"]


def build_dir(amx: bool) -> Path:
    return cache_root() / ("build-native" if amx else "build-noamx")


def source_tree() -> Path:
    """vendor/llama.cpp of the sdist, downloaded once with pip (the only download)."""
    tree = cache_root() / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    sdist_dir = cache_root() / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                        "--no-deps", f"llama-cpp-python=={VERSION}", "-d", str(sdist_dir)],
                       check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(cache_root() / "src", filter="data")
    return tree


def build(jobs: int = 2, amx: bool | None = None, targets: tuple[str, ...] = TARGETS) -> Path:
    """The folder of the built binaries (built now with `nice -n 19` if missing)."""
    if amx is None:
        amx, why = amx_works()
        print(f"AMX: {'on' if amx else 'off'} ({why})", flush=True)
    out = build_dir(amx)
    bins = out / "bin"
    if all((bins / t).is_file() for t in targets):
        return bins
    tree = source_tree()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    opts = cmake_options(amx, cpu_flags())
    print("cmake " + " ".join(opts), flush=True)
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), *gen, *opts], check=True)
    subprocess.run(["nice", "-n", "19", "cmake", "--build", str(out), "--target", *targets,
                    "-j", str(jobs)], check=True)
    return bins


def binary(name: str, amx: bool = False) -> Path:
    """A built tool; raises FileNotFoundError naming the build command when it is missing."""
    path = build_dir(amx) / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m bench.llama_cpp build`")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["build", "probe-amx", "path"])
    p.add_argument("name", nargs="?", default="llama-server")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--amx", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma list of tools to build")
    args = p.parse_args(argv)
    amx = {"auto": None, "on": True, "off": False}[args.amx]
    if args.what == "probe-amx":
        ok, why = amx_works()
        print(f"AMX {'works' if ok else 'does not work'}: {why}")
    elif args.what == "path":
        print(binary(args.name, bool(amx)))
    else:
        print(build(args.jobs, amx, tuple(t for t in args.targets.split(",") if t)))


if __name__ == "__main__":
    main()
