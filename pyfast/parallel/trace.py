"""Per-rank timelines of pipeline steps: Chrome trace JSON (Perfetto, chrome://tracing) and a
small matplotlib picture, so the bubble can be seen.

Timestamps are time.perf_counter(), CLOCK_MONOTONIC on Linux: one clock for every process on
the machine, so the ranks line up without synchronising. Across machines they would not.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

# kind -> (Chrome reserved colour name, matplotlib colour)
COLORS = {"forward": ("thread_state_running", "#4c8bf5"), "backward": ("rail_response", "#f29b38"),
          "weight-grad": ("good", "#3aa757"), "send": ("grey", "#555555"),
          "recv": ("grey", "#555555"), "idle": ("terrible", "#e4e4e4")}
_last = None  # the most recent traced step of this process, for save_trace(path)


class Recorder:
    """Events of one step on one rank, plus the activation bytes it held (saved tensors of the
    autograd graph, counted once per storage, parameters excluded)."""

    def __init__(self, rank: int, group=None):
        global _last
        self.rank, self.group, self.events, self._held = rank, group, [], {}
        self.live = self.peak_activation_bytes = 0
        _last = self

    def add(self, kind: str, label: str, t0: float, t1: float):
        self.events.append((kind, label, t0, t1))

    @contextlib.contextmanager
    def saving(self, key, params):
        """Count the bytes the autograd graph saves inside the block (a micro-batch's forward)
        until release(key): one count per storage, parameters (Linear saves weight.t()) excluded."""
        seen, skip = set(), {p.untyped_storage().data_ptr() for p in params}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip and ptr not in seen:
                seen.add(ptr)
                self._held[key] = self._held.get(key, 0) + t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.hold(self._held.get(key, 0))

    def release(self, key):
        self.hold(-self._held.pop(key, 0))

    def hold(self, nbytes: int):
        self.live += nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live)


def idle_fractions(per_rank: list[list[tuple]]) -> list[float]:
    """Each rank's bubble in a traced step: its seconds waiting on a peer ("idle" events) over
    its span (first event's start to last event's end); 0 for a rank with no events."""
    out = []
    for evs in per_rank:
        span = max((e[3] for e in evs), default=0.0) - min((e[2] for e in evs), default=0.0)
        idle = sum(e[3] - e[2] for e in evs if e[0] == "idle")
        out.append(idle / span if span > 0 else 0.0)
    return out


def chrome_events(per_rank: list[list[tuple]]) -> list[dict]:
    t0 = min((e[2] for evs in per_rank for e in evs), default=0.0)
    out = []
    for rank, evs in enumerate(per_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for kind, label, a, b in evs:
            out.append({"name": label, "cat": kind, "ph": "X", "pid": rank, "tid": 0,
                        "ts": (a - t0) * 1e6, "dur": (b - a) * 1e6, "cname": COLORS[kind][0]})
    return out


def plot(per_rank: list[list[tuple]], path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = min((e[2] for evs in per_rank for e in evs), default=0.0)
    span = max((e[3] for evs in per_rank for e in evs), default=t0 + 1) - t0
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(per_rank)), dpi=120)
    for rank, evs in enumerate(per_rank):
        for kind, label, a, b in evs:
            x, w = (a - t0) * 1e3, (b - a) * 1e3  # sends/receives show only when they are slow
            ax.broken_barh([(x, w)], (rank - 0.4, 0.8), color=COLORS[kind][1],
                           edgecolor="white" if kind != "idle" else "none", linewidth=0.3)
            if kind != "idle" and w > 0.02 * span * 1e3:  # label only boxes wide enough to read
                ax.text(x + w / 2, rank, label.split()[0], ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(per_rank)), [f"rank {r}, idle {100 * f:.0f}%"
                                          for r, f in enumerate(idle_fractions(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title((title + "\n" if title else "") + "blue F, orange B or I, green W, dark grey "
                 "send/recv calls, light grey waiting", fontsize=9)
    fig.tight_layout()
    try:
        with _atomic(path, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)


@contextlib.contextmanager
def _atomic(path: str, mode: str = "w"):
    """Write `path` whole or not at all: into a temporary file in the same directory (so the
    rename stays on one file system), then os.replace. A failure midway leaves any earlier
    file at `path` untouched and no temporary behind."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_trace(path: str, recorder: Recorder | None = None, title: str = "") -> str | None:
    """Write the last traced step (`step(..., trace=True)`) of every rank as Chrome trace JSON
    at `path`, and its timeline picture next to it (`.png`). Collective: call it on every rank
    of the pipeline's group; rank 0 of the group writes and gets the path, the others None.
    Each file is written atomically (a temporary file in its directory, then os.replace): a
    crash or an error midway never leaves a truncated trace."""
    rec = recorder or _last
    if rec is None:
        raise RuntimeError("save_trace: no traced step in this process; call step(..., trace=True)")
    if rec.group is not None and dist.get_world_size(rec.group) > 1:
        gathered = [None] * dist.get_world_size(rec.group)
        dist.all_gather_object(gathered, rec.events, group=rec.group)
    else:
        gathered = [rec.events]
    if rec.rank != 0:
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with _atomic(path) as f:
        json.dump({"traceEvents": chrome_events(gathered), "displayTimeUnit": "ms",
                   "otherData": {"written": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "idle_fraction": idle_fractions(gathered)}}, f)
    plot(gathered, os.path.splitext(path)[0] + ".png", title)
    return path
