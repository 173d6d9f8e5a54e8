"""Backend choice for every op: triton (CUDA tensors), cpp (CPU tensors), torch (reference).

`PYFAST_BACKEND=torch|cpp|triton` (or an op's `backend=` argument) forces one; a forced backend
that cannot run raises BackendUnavailable saying why. Nothing falls back silently: the automatic
choice falls back to the reference only when the fast path is not installed at all, and says so
once (and `pyfast info` lists why).
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

BACKENDS = ("torch", "cpp", "triton")
OPS = ("quantize", "dequantize", "dequantize_accumulate_", "topk_count", "topk_select")


class BackendUnavailable(RuntimeError):
    """A backend was asked for by name but cannot run here."""


@functools.lru_cache(maxsize=None)
def cpp_status() -> tuple[bool, str]:
    try:
        import pyfast._C  # noqa: F401  (registers torch.ops.pyfast.*)
    except ImportError as e:  # not built, or built against another torch
        return False, f"the C++ extension pyfast._C is not importable ({e}); run `make install`"
    missing = [op for op in OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(
        f"pyfast::{op}", "CPU")]
    if missing:
        return False, f"pyfast._C has no CPU kernel for {', '.join(missing)} (stale build?)"
    import pyfast.ops._fake  # noqa: F401  (shapes for torch.compile; needs the ops defined)
    return True, ""


def triton_status(device: torch.device | None = None) -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"triton is not installed ({e})"
    try:
        import pyfast.kernels  # noqa: F401
    except ImportError as e:
        return False, f"pyfast.kernels is not installed ({e}); run `make install`"
    on_cpu = device is None or device.type == "cpu"
    if on_cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False, ("Triton kernels need a CUDA device; on CPU they run only in Triton's "
                           "interpreter: set TRITON_INTERPRET=1 before pyfast is imported")
        from triton import knobs
        if not knobs.runtime.interpret:
            return False, "TRITON_INTERPRET=1 was set after triton read it; set it before import"
    elif device.type != "cuda":
        return False, f"Triton kernels run on CUDA tensors, not {device.type}"
    return True, ""


def status(name: str, device: torch.device | None = None) -> tuple[bool, str]:
    if name == "torch":
        return True, ""
    if name == "cpp":
        ok, why = cpp_status()
        if ok and device is not None and device.type not in ("cpu", "cuda", "meta"):
            return False, (f"pyfast._C has kernels for cpu (and cuda where built) and fakes for "
                           f"meta, not {device.type}")
        if ok and device is not None and device.type == "cuda" and not \
                torch._C._dispatch_has_kernel_for_dispatch_key("pyfast::quantize", "CUDA"):
            return False, "pyfast._C was built without CUDA kernels (CPU-only torch or no nvcc)"
        return ok, why
    if name == "triton":
        return triton_status(device)
    raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")


@functools.lru_cache(maxsize=None)
def _warn_fallback(device_type: str, why: str) -> None:
    warnings.warn(f"pyfast: no fast path for {device_type} tensors ({why}); using the torch "
                  "reference. Set PYFAST_BACKEND to make this an error.", stacklevel=3)


def resolve_cpu_op(device: torch.device, backend: str | None, op: str, key: str,
                   source: str, devices: tuple = ("cpu",)) -> str:
    """resolve() for an op with a C++ kernel only (registered as pyfast::`key` for CPU, from
    csrc/`source`) and no Triton one: "cpp" where the kernel runs (devices: the tensor devices it
    serves, "meta" for one with a fake), else the torch reference, with a warning when the
    backend was auto; a backend asked for by name (argument or PYFAST_BACKEND) that cannot run
    the op raises BackendUnavailable: no silent fallback."""
    asked = (backend or os.environ.get("PYFAST_BACKEND") or "auto") != "auto"
    b = resolve(device, backend)
    missing = None
    if b == "cpp" and device.type not in devices:
        missing = f"{op} has a C++ kernel for cpu tensors only, not {device.type}"
    elif b == "cpp" and not torch._C._dispatch_has_kernel_for_dispatch_key(f"pyfast::{key}",
                                                                            "CPU"):
        missing = (f"pyfast._C has no {op} kernel (built before csrc/{source}: run "
                   "`make install`)")
    elif b == "triton":
        missing = f"{op} has no Triton kernel"
    if missing and asked:
        raise BackendUnavailable(f"backend {b!r} was asked for but cannot run {op}: {missing}")
    if missing:
        _warn_fallback(device.type, missing)
        return "torch"
    return b


def resolve(device: torch.device, backend: str | None = None) -> str:
    """Name of the backend that runs an op on `device`."""
    name = backend or os.environ.get("PYFAST_BACKEND") or "auto"
    if name == "auto":
        # meta (a dry run): the dispatcher's ops, whose registered fakes (_fake.py) give the
        # outputs the kernels would make; the torch reference would allocate otherwise
        want = {"cuda": "triton", "cpu": "cpp", "meta": "cpp"}.get(device.type)
        if want is None:
            return "torch"
        ok, why = status(want, device)
        if ok:
            return want
        _warn_fallback(device.type, why)
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"PYFAST_BACKEND={name!r} is not a backend; valid: auto, {', '.join(BACKENDS)}")
    ok, why = status(name, device)
    if not ok:
        raise BackendUnavailable(f"backend {name!r} was asked for but cannot run: {why}")
    return name
