"""The attention registry: every backend module that imports here has the Backend protocol's
members with the reference's signatures (its NAME its registry name), and a new backend is one
module plus one `register` line (get_backend and auto find it)."""

from __future__ import annotations

import importlib
import inspect
import sys
import types

import pytest

from kernels import attention
from kernels.attention import BACKENDS, auto_backend, get_backend, register, torch_backend
from kernels.cpu import fused as cpu_fused


def _importable() -> list[str]:
    names = []
    for name, reg in BACKENDS.items():
        try:
            importlib.import_module(reg.module)
        except ImportError:
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("name", _importable())
def test_backends_have_the_protocols_members(name: str) -> None:
    module = importlib.import_module(BACKENDS[name].module)
    assert isinstance(module.FUSED_CPU_OPS, bool)
    assert module.NAME == name
    for fn in ("write_kv", "paged_attention"):
        got = inspect.signature(getattr(module, fn)).parameters
        want = inspect.signature(getattr(torch_backend, fn)).parameters

        def positional(ps):
            return [p for p in ps.values() if p.kind is not p.KEYWORD_ONLY]

        # the reference's positional parameters in order, its keyword-only ones by name; a
        # backend's extras (triton's num_kv_splits) are keyword-only with defaults
        assert [p.name for p in positional(got)] == [p.name for p in positional(want)]
        keywords = {n for n, p in got.items() if p.kind is p.KEYWORD_ONLY}
        assert {n for n, p in want.items() if p.kind is p.KEYWORD_ONLY} <= keywords, (name, fn)
        assert all(got[n].default is not got[n].empty for n in keywords - set(want)), (name, fn)


def test_a_new_backend_is_one_module_and_one_register_line(monkeypatch) -> None:
    module = types.ModuleType("tests_fake_backend")
    module.write_kv = torch_backend.write_kv
    module.paged_attention = torch_backend.paged_attention
    module.FUSED_CPU_OPS = False
    module.NAME = "fake"
    monkeypatch.setitem(sys.modules, "tests_fake_backend", module)
    monkeypatch.setattr(attention, "BACKENDS", dict(BACKENDS))
    register("fake", "tests_fake_backend", auto_on=("xpu",), runs_on=("xpu",))
    assert get_backend("fake", "xpu") is module
    assert auto_backend("xpu") == "fake"
    assert get_backend("auto", "xpu") is module
    with pytest.raises(ValueError, match="runs on xpu only"):
        get_backend("fake", "cpu")
    assert auto_backend("mps") == "torch"


def test_the_cpu_decode_stack_knows_its_backend_by_name_not_by_module(monkeypatch) -> None:
    """kernels/cpu/fused.py runs with the backend whose NAME is "cpu", whichever object it is
    (not by a look-up in sys.modules); with any other backend the per-layer path runs."""
    monkeypatch.setattr(cpu_fused, "available", lambda: True)  # NOTE: no compiler needed
    twin = types.ModuleType("tests_cpu_twin")
    twin.NAME = "cpu"
    assert "tests_cpu_twin" not in sys.modules
    assert cpu_fused.runs_with(twin)
    assert not cpu_fused.runs_with(torch_backend)
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    assert not cpu_fused.runs_with(twin)  # the library did not build
