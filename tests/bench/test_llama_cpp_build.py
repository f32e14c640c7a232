"""bench/llama_cpp.py's pieces that need no build: the CMake options for a CPU, the AMX probe."""

from __future__ import annotations

from bench import llama_cpp


def test_without_amx_every_listed_isa_is_on_and_amx_off() -> None:
    flags = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_int8"}
    opts = llama_cpp.cmake_options(False, flags)
    assert "-DGGML_NATIVE=OFF" in opts and "-DLLAMA_CURL=OFF" in opts
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{on}=ON" in opts
    assert "-DGGML_AVX512_VBMI=OFF" in opts and "-DGGML_AVX_VNNI=OFF" in opts  # not listed
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(opts)


def test_with_working_amx_the_build_is_native() -> None:
    opts = llama_cpp.cmake_options(True, set())
    assert "-DGGML_NATIVE=ON" in opts and "-DLLAMA_CURL=OFF" in opts
    assert not any("AMX" in o for o in opts)


def test_the_amx_probe_answers_from_running_it() -> None:
    ok, why = llama_cpp.amx_works()
    if "amx_tile" not in llama_cpp.cpu_flags():
        assert not ok and "does not list" in why
    elif ok:  # NOTE: listed and it ran: the int8 tile product was checked in the child
        assert why == "an AMX tile instruction ran"
    else:  # listed, but refused or faulting (the VMs of NOTES.md)
        assert any(w in why for w in ("refused", "faults", "wrong", "compile"))


def test_the_probe_checks_the_tile_product_it_computes() -> None:
    assert "_tile_dpbssd" in llama_cpp.AMX_PROBE and "ARCH_REQ_XCOMP_PERM" in llama_cpp.AMX_PROBE


def test_builds_are_cached_outside_the_repo_per_amx(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert llama_cpp.build_dir(False) == tmp_path / "llama.cpp-0.3.36" / "build-noamx"
    assert llama_cpp.build_dir(True) == tmp_path / "llama.cpp-0.3.36" / "build-native"
