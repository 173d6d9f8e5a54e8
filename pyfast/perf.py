"""The benchmark harness shared by every `pyfast bench X` and bench/: timing with medians and
quantiles under one set of key names (median_s, q10_s, q90_s), copy bandwidth, the machine's
name, the result saved as JSON + a table (TXT) atomically, and one entry point per benchmark.
Also the one clock of every timing in pyfast that can see device work: clock(device)."""
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
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, "
            f"{n} thread{'s' * (n != 1)}")


def sync(device=None) -> None:
    """Wait until `device` has done the work queued on it: torch.cuda.synchronize for a CUDA
    device (a kernel runs after the call that launched it returns), nothing for the CPU (its
    ops return done), meta (no work) or None."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_of(x):
    """The device whose work timing `x` must wait for: a tensor's, a module's first
    parameter's (None without one), a list's first element's that has one, a device as it
    is, None for anything else."""
    if isinstance(x, (list, tuple)):
        return next((d for d in map(device_of, x) if d is not None), None)
    if isinstance(x, torch.nn.Module):
        return next((p.device for p in x.parameters()), None)
    if isinstance(x, (torch.Tensor, torch.nn.Parameter)):
        return x.device
    return x if isinstance(x, (torch.device, str)) else None


def clock(device=None) -> float:
    """time.perf_counter() once `device`'s queued work is done. Every timing that can see
    device work reads this at both ends: on CUDA, perf_counter alone times the launches."""
    sync(device)
    return time.perf_counter()


KEYS = ("median_s", "q10_s", "q90_s")
LEGACY = {"median_s": ("time_s", "median", "step_s"), "q10_s": ("q10",), "q90_s": ("q90",)}  # older results


def summary(times) -> dict:
    """{"median_s", "q10_s", "q90_s"} of a list of seconds: the keys every result row uses."""
    ts = sorted(times)
    if not ts:
        raise ValueError("summary of no times")
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return {"median_s": statistics.median(ts), "q10_s": q(0.1), "q90_s": q(0.9)}


def stat(row: dict, key: str):
    """row[key] for key in KEYS, also from results recorded before the keys were unified."""
    for k in (key, *LEGACY.get(key, ())):
        if k in row:
            return row[k]
    raise KeyError(key)


def times(fn, repeats: int = 7, warmup: int = 1, min_time: float = 0.0,
          device=None) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn() (more until min_time) after `warmup`,
    `device` (where fn's work runs) synchronized at both ends of each (clock)."""
    for _ in range(warmup):
        fn()
    ts = []
    start = clock(device)
    while len(ts) < repeats or time.perf_counter() - start < min_time:
        t0 = clock(device)
        fn()
        ts.append(clock(device) - t0)
    return ts


def median_time(fn, repeats: int = 7, warmup: int = 1, min_time: float = 0.0,
                device=None) -> tuple[float, float, float]:
    """(median, q10, q90) wall seconds of fn() over `repeats` runs after `warmup` (summary())."""
    s = summary(times(fn, repeats, warmup, min_time, device))
    return s["median_s"], s["q10_s"], s["q90_s"]


def copy_bandwidth(x: torch.Tensor, repeats: int = 7) -> float:
    """Bytes read + written per second by y.copy_(x): the memory roof for one pass."""
    y = torch.empty_like(x)
    t, _, _ = median_time(lambda: y.copy_(x), repeats, device=x.device)
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


def columns(table, names, left=(), **kw):
    """Add the columns `names` to a rich Table: labels (those in `left`) left-justified,
    numbers right-justified; `kw` goes to every add_column. Returns the table."""
    for name in names:
        table.add_column(name, justify="left" if name in left else "right", **kw)
    return table


def rich_table(title: str, result: dict, names, left=(), **kw):
    """The table of a benchmark's result: `title`, then a line naming the machine and the
    date the result was measured on, and the columns `names` (columns())."""
    from rich.table import Table
    return columns(Table(title=f"{title}\n{result['machine']}; {result['date']}"), names, left,
                   **kw)


def show(result: dict, table, width: int = 160, file=None) -> None:
    """Print table(result): a rich Table or plain text."""
    from rich.console import Console
    t = table(result)
    if isinstance(t, str):
        print(t, file=file)
    else:
        Console(file=file, width=width).print(t)


def save_result(result: dict, out: str, table, width: int = 160) -> None:
    """Write OUT.json (the data) and OUT.txt (the table) for a benchmark result, atomically."""
    import json

    from pyfast._io import atomic_open, atomic_write_text
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    atomic_write_text(out + ".json", json.dumps(result, indent=1))
    with atomic_open(out + ".txt", "w") as f:
        show(result, table, width, file=f)


def finish(result: dict, table, out: str = "", width: int = 160) -> int:
    """The end of every benchmark's main(): show the table, save OUT.json/.txt if asked."""
    show(result, table, width)
    if out:
        save_result(result, out, table, width)
        print(f"wrote {out}.json and {out}.txt")
    return 0
