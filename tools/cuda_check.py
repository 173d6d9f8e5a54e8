"""Compile CUDA sources to object files against torch's headers (no GPU, no CUDA torch needed).

Usage: python tools/cuda_check.py --nvcc /path/to/nvcc [csrc/cuda/*.cu]
Proves the CUDA sources build where nothing can link or run them: the kernels and the overlap
engine's CUDA half (csrc/cuda/engine_cuda.cu: events, side stream). With no sources it compiles
SOURCES, the CUDA sources setup.py adds to the CUDAExtension build. The flags are the ones torch's
CUDAExtension passes (setup.py): torch's include dirs, its COMMON_NVCC_FLAGS (half/bf16
operator macros), the extension-name defines, plus setup.py's `-O3 --fmad=false` and
`-DPYFAST_WITH_CUDA` (the CUDA build's macro). The CUDA
runtime headers come from the nvcc installation itself (nvcc adds its own include dir).
"""
import argparse
import glob
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch
from torch.utils import cpp_extension

ARCHS = ("80", "90")  # A100, H100: real SASS for each, as a wheel build would emit
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = "csrc/cuda/*.cu"  # setup.py's glob for the CUDAExtension


def sources() -> list[str]:
    """The default sources, relative to the repository root, in setup.py's order."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, SOURCES)))


def nvcc_flags(std: str = "c++17") -> list[str]:
    # device_type="cpu": torch's own include dirs only. "cuda" would also add CUDA_HOME/include,
    # and CUDA_HOME is None where torch is a CPU build; nvcc finds its runtime headers anyway.
    incs = cpp_extension.include_paths(device_type="cpu")
    incs.append(sysconfig.get_paths()["include"])  # Python.h (torch/extension.h pulls it in)
    flags = ["-c", f"-std={std}", "-O3", "--fmad=false", "-Xcompiler", "-fPIC",
             "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DPYFAST_WITH_CUDA",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # A CPU wheel ships c10/cuda but not the generated c10/cuda/impl/cuda_cmake_macros.h;
    # it only sets C10_CUDA_BUILD_SHARED_LIBS (dllexport, Windows), so skipping it is harmless.
    flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    flags += cpp_extension.COMMON_NVCC_FLAGS  # -D__CUDA_NO_HALF_OPERATORS__ ... as CUDAExtension
    flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    return flags + [f"-I{d}" for d in incs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", required=True, help="the nvcc executable")
    # torch 2.13's CUDAExtension adds -std=c++20 when no -std is given (setup.py gives none for
    # nvcc); its headers also build as C++17 (with a warning about bit-field initializers).
    ap.add_argument("--std", default="c++17", help="C++ standard for nvcc (default c++17)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each command")
    ap.add_argument("sources", nargs="*", help=f".cu files (default: {SOURCES})")
    args = ap.parse_args()
    srcs = args.sources or [os.path.join(ROOT, s) for s in sources()]
    if not srcs:
        sys.stderr.write(f"cuda_check: no sources ({SOURCES} matched nothing)\n")
        return 1
    failed = 0
    with tempfile.TemporaryDirectory(prefix="cuda_check_") as tmp:
        flags = nvcc_flags(args.std)
        for src in srcs:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [args.nvcc, *flags, src, "-o", obj]
            if args.verbose:
                print(" ".join(cmd))
            t0 = time.monotonic()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True)
                ok, log = p.returncode == 0, p.stdout + p.stderr
            except OSError as e:  # nvcc missing or not executable
                ok, log = False, str(e)
            dt = time.monotonic() - t0
            print(f"{'OK' if ok else 'FAILED':6} {src} ({dt:.1f} s)", flush=True)
            if not ok:
                failed += 1
                sys.stderr.write(log if log.endswith("\n") else log + "\n")
    if failed:
        sys.stderr.write(f"cuda_check: {failed} of {len(srcs)} sources FAILED to compile\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
