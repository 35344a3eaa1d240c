"""Print the CMAKE_ARGS that build llama-cpp-python's llama.cpp for this CPU (used by `make llamacpp`).

llama.cpp builds with ``-march=native`` by default. On a CPU that reports Intel AMX but whose
kernel or hypervisor has not enabled its tile state (seen on this project's VMs), the AMX kernels
then die on their first instruction (``ldtilecfg``: a general protection fault in the first decode).
There, build for the CPU's other features explicitly and leave AMX out.

Everywhere, the multimodal library (``mtmd``, which llama-cpp-python builds by default and loads only
for image chat) is left out: the toolkit runs text models only, and the build is shorter without it.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flag -> ggml's CMake option, for the x86 features ggml builds kernels for
FEATURES = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx512f": "GGML_AVX512",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "avx_vnni": "GGML_AVX_VNNI",
}


TEXT_ONLY = "-DLLAVA_BUILD=OFF"


def cmake_args(cpuinfo: str) -> str:
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    if "amx_tile" not in flags:
        return TEXT_ONLY  # llama.cpp's default (native) build is right
    options = [f"-D{option}=ON" for flag, option in FEATURES.items() if flag in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *options, TEXT_ONLY])


if __name__ == "__main__":
    info = Path("/proc/cpuinfo")
    print(cmake_args(info.read_text() if info.exists() else ""))
