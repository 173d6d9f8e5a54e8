"""Named ranges `pyfast.<area>.<what>` for profilers: where pyfast's collectives, codec kernels,
bucket waits and pipeline actions run, in torch.profiler's trace (record_function) and, on CUDA,
in Nsight Systems' timeline (NVTX).

    with span("pyfast.comm.all_reduce"):        a block
    @ranged("pyfast.dp.wait")                   a whole function (one line at the definition)

Areas (AREAS): comm (collectives), codec (compress / decode), dp (DataParallel's bucket
launch and its wait after backward), zero (ZeRO's reduce, wait, gather, step), pipe (pipeline
actions F, B, I, W, its sends, receive posts and waits), tp, cp (their collectives), data (the
job's batch fetch), optim (the optimizer step). pyfast.train.profile reads them back into the
per-step split (compute, exposed communication, codec, bubble, data).

Costs: with no profiler running, a range is one check of torch's own flag
(torch.autograd.profiler._is_profiler_enabled, set by torch.profiler.profile, emit_nvtx and
the legacy profiler alike) and returns a shared no-op: 0.17 us a `with span(...)` block and
0.12 us a `ranged` call on the 2-core Intel Xeon VM, loaded (bench/results/profile_overhead.txt:
17 ranges a gpt-small dp2 step, 3 us of a 1 s step). Under a profiler it is a record_function. NVTX: on when NVTX_INJECTION64_PATH is set (Nsight
Systems sets it for the process it profiles: without a tool attached NVTX calls do nothing) or
PYFAST_NVTX=1, and CUDA is available; nvtx.range_push/pop then also run with no torch profiler.

PYFAST_RANGES=0 (read at import, private: the overhead benchmark's baseline) turns every range
off: `ranged` returns the function itself, undecorated, and `span` the no-op at once.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch.autograd.profiler as _ap

AREAS = ("comm", "codec", "dp", "zero", "pipe", "tp", "cp", "data", "optim")

_NULL = contextlib.nullcontext()
_OFF = os.environ.get("PYFAST_RANGES") == "0"
_NVTX_ASKED = not _OFF and (os.environ.get("PYFAST_NVTX") == "1"
                            or bool(os.environ.get("NVTX_INJECTION64_PATH")))
_nvtx = None  # torch.cuda.nvtx once NVTX was asked for and CUDA found (decided on first use)


def _nvtx_module():
    global _nvtx, _NVTX_ASKED
    if _nvtx is None:
        import torch
        if torch.cuda.is_available():
            _nvtx = torch.cuda.nvtx
        else:  # asked for on a machine without CUDA: nothing to mark
            _NVTX_ASKED = False
    return _nvtx


class _Range:
    """record_function(name) while a torch profiler runs, plus an NVTX range when asked."""
    __slots__ = ("name", "rf", "nv")

    def __init__(self, name: str):
        self.name, self.rf, self.nv = name, None, None

    def __enter__(self):
        if _NVTX_ASKED and _nvtx_module() is not None:
            self.nv = _nvtx
            self.nv.range_push(self.name)
        if _ap._is_profiler_enabled:
            self.rf = _ap.record_function(self.name)
            self.rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.rf is not None:
            self.rf.__exit__(*exc)
        if self.nv is not None:
            self.nv.range_pop()
        return False


def span(name: str):
    """A context manager marking its block as `name` (pyfast.<area>.<what>) in a running
    profiler's trace; a shared no-op when none runs."""
    if _ap._is_profiler_enabled or _NVTX_ASKED:
        return _Range(name)
    return _NULL


def ranged(name: str):
    """Decorator: every call of the function is a range `name` (span's rules). Generators are
    not supported (the range would close at the first yield)."""
    def deco(fn):
        if _OFF:
            return fn

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not (_ap._is_profiler_enabled or _NVTX_ASKED):
                return fn(*args, **kwargs)
            with _Range(name):
                return fn(*args, **kwargs)
        return run
    return deco


if _OFF:  # the baseline: no check at all, the shared no-op
    def span(name: str):  # noqa: F811
        return _NULL


def active() -> bool:
    """Whether ranges are recorded now (a torch profiler runs, or NVTX was asked for)."""
    return not _OFF and (_ap._is_profiler_enabled or _NVTX_ASKED)
