"""Builds pyfast and its extension pyfast._C.

CPU: CppExtension over csrc/*.cpp with -O3 and OpenMP. CUDA: CUDAExtension adding
csrc/cuda/*.cu (the kernels and the overlap engine's CUDA half) and defining PYFAST_WITH_CUDA,
only where torch is a CUDA build and nvcc exists (CUDA_HOME). Install with
`pip install --no-build-isolation .` after torch: build isolation would fetch another torch.
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# -ffp-contract=off: an FMA in (x * inv + M) - M would change round-to-nearest codes, which
# must equal the Triton and torch ones bit for bit (docs/FORMATS.md).
# -fno-math-errno: with errno semantics GCC keeps sqrtf a scalar call and csrc/adamw.cpp's
# loop scalar with it: 1.47-1.56 vs 0.34-0.37 ns an element from L2 (one core of this VM,
# 2026-11-29); no kernel reads errno, and no result changes.
cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c++17"]
if os.environ.get("PYFAST_PORTABLE") != "1":
    cxx.append("-march=native")  # AVX2 on this machine: quantize loops vectorize 8-wide
use_cuda = torch.version.cuda is not None and CUDA_HOME is not None
sources = sorted(glob.glob("csrc/*.cpp"))
if use_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))  # tools/cuda_check.py's SOURCES
    # The engine's shared sources (csrc/engine.cpp, module.cpp) see it too: kWithCuda.
    with_cuda = ["-DPYFAST_WITH_CUDA"]
    ext = CUDAExtension("pyfast._C", sources, extra_compile_args={
        "cxx": cxx + with_cuda, "nvcc": ["-O3", "--fmad=false"] + with_cuda},
        extra_link_args=["-fopenmp"])
else:
    ext = CppExtension("pyfast._C", sources, extra_compile_args={"cxx": cxx},
                       extra_link_args=["-fopenmp"])

setup(
    packages=["pyfast", "pyfast.ops", "pyfast.compress", "pyfast.comm", "pyfast.parallel",
              "pyfast.benchmarks", "pyfast.kernels"],
    package_dir={"pyfast.kernels": "kernels"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
