"""Timing helpers shared by `pyfast bench` and bench/: medians, copy bandwidth, machine name."""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    n = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {n} thread{'s' * (n != 1)}"


def median_time(fn, repeats: int = 7, warmup: int = 1, min_time: float = 0.0) -> tuple[float, float, float]:
    """(median, q10, q90) wall seconds of fn() over `repeats` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    ts = []
    start = time.perf_counter()
    while len(ts) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return statistics.median(ts), q(0.1), q(0.9)


def copy_bandwidth(x: torch.Tensor, repeats: int = 7) -> float:
    """Bytes read + written per second by y.copy_(x): the memory roof for one pass."""
    y = torch.empty_like(x)
    t, _, _ = median_time(lambda: y.copy_(x), repeats)
    return 2 * x.numel() * x.element_size() / t


@contextlib.contextmanager
def backend(name: str | None):
    """Force PYFAST_BACKEND inside the block (None: leave the automatic choice)."""
    old = os.environ.get("PYFAST_BACKEND")
    if name is not None:
        os.environ["PYFAST_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYFAST_BACKEND", None)
        else:
            os.environ["PYFAST_BACKEND"] = old


def save_result(result: dict, out: str, table, width: int = 160) -> None:
    """Write OUT.json (the data) and OUT.txt (the rich table) for a benchmark result."""
    import json

    from rich.console import Console

    from pyfast._io import atomic_open, atomic_write_text
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    atomic_write_text(out + ".json", json.dumps(result, indent=1))
    with atomic_open(out + ".txt", "w") as f:
        Console(file=f, width=width).print(table(result))
