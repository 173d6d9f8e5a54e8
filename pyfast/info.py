"""`pyfast info`: versions, which backends run here (and why not), and the GPUs."""
from __future__ import annotations

import platform

import torch

import pyfast
from pyfast.ops import _backend


def gpus() -> list[str]:
    """One line per NVIDIA GPU (name, memory, active NVLink links), or why there are none."""
    try:
        import pynvml
    except ImportError:
        return ["GPUs: unknown (nvidia-ml-py is not installed: pip install nvidia-ml-py)"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [f"GPUs: none (no NVIDIA driver here: {e})"]
    try:
        lines = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2 ** 30
            links = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break  # no NVLink on this device (or past its last link)
            lines.append(f"GPU {i}: {name}, {mem:.1f} GiB, {links} NVLink links active")
        return lines or ["GPUs: none (driver present, 0 devices)"]
    finally:
        pynvml.nvmlShutdown()


def report() -> list[str]:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    lines = [f"pyfast {pyfast.__version__}, torch {torch.__version__}, triton {tv}, "
             f"python {platform.python_version()}",
             f"torch CUDA build: {torch.version.cuda or 'no (CPU build)'}; "
             f"CUDA devices: {torch.cuda.device_count() if torch.cuda.is_available() else 0}",
             "backends:"]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    checks = [("torch", cpu, "reference, any device"),
              ("cpp", cpu, "C++/OpenMP kernels for CPU tensors"),
              ("cpp", cuda, "CUDA kernels in pyfast._C for CUDA tensors"),
              ("triton", cuda, "Triton kernels for CUDA tensors"),
              ("triton", cpu, "Triton interpreter on CPU tensors (tests only)")]
    for name, dev, what in checks:
        if dev.type == "cuda" and name == "cpp" and not _backend.cpp_status()[0]:
            ok, why = _backend.cpp_status()
        elif dev.type == "cuda" and not torch.cuda.is_available():
            ok, why = False, "no CUDA device here"
        else:
            ok, why = _backend.status(name, dev)
        lines.append(f"  {name:6s} {dev.type:4s} {'yes' if ok else 'no '}  {what}"
                     + ("" if ok else f": {why}"))
    return lines + gpus()
