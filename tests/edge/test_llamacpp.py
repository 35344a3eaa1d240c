"""The llama.cpp runtime: its build flags, its input checks, and (with the extra installed) its answers."""

import sys
from pathlib import Path

import pytest

from ciders_edge.errors import ExportError
from ciders_edge.inference.llamacpp import check_gguf

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
from llamacpp_cmake_args import cmake_args  # noqa: E402

AMX_CPU = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n"


def test_a_cpu_with_amx_builds_its_other_features_explicitly():
    """-march=native on a VM that reports AMX without enabling it builds kernels that fault at once."""
    args = cmake_args(AMX_CPU).split()
    assert args[0] == "-DGGML_NATIVE=OFF" and "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX2=ON" in args
    assert not [a for a in args if "AMX" in a] and "-DGGML_AVX512_BF16=ON" not in args  # only what it has
    assert args[-1] == "-DLLAVA_BUILD=OFF"


def test_a_cpu_without_amx_keeps_the_native_build():
    assert cmake_args(AMX_CPU.replace(" amx_tile amx_int8", "")) == "-DLLAVA_BUILD=OFF"  # text models only


def test_a_file_that_is_not_gguf_is_refused_before_llama_cpp_reads_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ExportError, match=r"model.gguf: not a GGUF file \(starts with b'PK"):
        check_gguf(bad)
