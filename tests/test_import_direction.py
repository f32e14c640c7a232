"""The import direction of DESIGN.md: ipc <- gateway, ipc + kernels <- engine; no torch in the
gateway; the engine's scheduling side (engine/sched) and compute side (engine/run) joined by
engine/step_plan.py alone; and transformers keeps working although our `kernels` package
shadows a PyPI name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY_OF = {
    "ipc": {"msgspec", "zmq"},
    "kernels": {"torch", "triton", "flash_attn", "numpy"},
}
FORBIDDEN = {
    "ipc": {"gateway", "engine", "kernels", "torch", "transformers"},
    "gateway": {"engine", "kernels", "torch", "transformers"},
    "engine": {"gateway"},
    "kernels": {"gateway", "engine", "ipc"},
}


def imported_roots(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.name)
    return found


# NOTE: by module prefix: engine/sched never imports torch nor the compute side; engine/run
# never imports the scheduling side; step_plan.py is the one module both import.
ENGINE_SIDES = {
    "engine/sched": ("torch", "kernels", "engine.run", "engine.models", "engine.parallel",
                     "engine.core", "engine.llm", "engine.process"),
    "engine/run": ("engine.sched",),
}
SCHED_MAY_IMPORT = ("engine.sched", "engine.step_plan", "ipc", "msgspec", "numpy", "llguidance",
                    "tokenizers")


def imported_modules(folder: str) -> dict[str, set[str]]:
    """Every module name imported anywhere in the folder's files (TYPE_CHECKING ones too)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # NOTE: `from engine.sched import beams` imports engine.sched.beams
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                assert not isinstance(node, ast.ImportFrom), f"relative import in {path}"
                continue
            for name in names:
                found.setdefault(name, set()).add(path.name)
    return found


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder", sorted(ENGINE_SIDES))
def test_engine_sides_import_one_way(folder):
    found = imported_modules(folder)
    bad = {name: sorted(files) for name, files in found.items()
           if _under(name, ENGINE_SIDES[folder])}
    assert not bad, f"{folder} imports {bad}"


def test_the_scheduling_side_imports_only_ipc_and_the_step_plan():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = imported_modules("engine/sched")
    bad = {name: sorted(files) for name, files in found.items()
           if name.split(".")[0] not in stdlib and not _under(name, SCHED_MAY_IMPORT)
           and name != "engine"}
    assert not bad, f"engine/sched imports {bad}"


def test_the_scheduling_side_loads_without_torch():
    code = (
        "import importlib, pkgutil, sys\n"
        "import engine.sched as pkg\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = {m if m.startswith('engine') else m.split('.')[0] for m in sys.modules\n"
        "       if m.split('.')[0] in ('torch', 'kernels', 'transformers')\n"
        "       or m.startswith(('engine.run', 'engine.models', 'engine.parallel'))}\n"
        "assert not bad, sorted(bad)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    roots = imported_roots(package)
    bad = {name: sorted(files) for name, files in roots.items() if name in FORBIDDEN[package]}
    assert not bad, f"{package} imports {bad}"


@pytest.mark.parametrize("package", sorted(THIRD_PARTY_OF))
def test_only_allowed_third_party(package):
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    allowed = stdlib | THIRD_PARTY_OF[package] | {package}
    roots = imported_roots(package)
    bad = {name: sorted(files) for name, files in roots.items() if name not in allowed}
    assert not bad, f"{package} imports {bad}"


def test_gateway_and_ipc_load_without_torch():
    code = (
        "import importlib, pkgutil, sys\n"
        "import gateway, ipc\n"
        "for pkg in (gateway, ipc):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = [m for m in ('torch', 'transformers', 'engine', 'kernels') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_transformers_still_loads_models_next_to_our_kernels_package(tiny_model_dir):
    code = (
        "import kernels, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})\n"
        "out = m(torch.tensor([[1, 2, 3]])).logits\n"
        "assert out.shape[-1] == 49152\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_the_command_line_spawns_before_it_imports_the_web_stack():
    """`pagedserve serve` spawns its engines with only gateway/cli.py's imports loaded; the web
    stack (gateway/serving.py) comes after, beside the engines' start."""
    code = (
        "import sys\n"
        "import gateway.cli\n"
        "web = ('uvicorn', 'starlette', 'structlog', 'gateway.app', 'gateway.service',\n"
        "       'gateway.serving', 'gateway.generation', 'gateway.tokenizer')\n"
        "bad = [m for m in web if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
