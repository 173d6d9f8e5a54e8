"""Emulated mixed hardware: cap one process's CPU time with a cgroup, so that ranks on one box
run at different speeds (a 2:1 pair: the slow rank capped at half a core beside a fast rank
with a whole one).

    with throttle(0.5): ...            # this process (every thread) at most 0.5 CPU
    hold(0.5)                          # in a rank entry point: held until the process exits
    available() -> "" or why not       # root and a cgroup cpu controller (v1 or v2)

The cap is a CFS bandwidth quota: `share` x the period (100 ms) of CPU time per period, over
all the process's threads together (gloo's I/O threads and OpenMP's included), which is what
a GPU or a node of another generation looks like to its peers: the same work, later. One
rank's share is all the cap says: on a 2-core box with two single-threaded ranks, 0.5 makes
that rank half as fast as its peer (its peer keeps a core), and a rank waiting in a collective
uses no quota. The cgroup is made per process (pyfast_<pid>_<n>) and removed on exit from the
block; one left behind by a killed process holds no task and is removed by the next
throttle() (rmdir of an empty group).

Where it cannot run (not root, no cpu controller), HeteroUnavailable says why: callers skip,
never silently run unthrottled. Like pyfast.netns it imports nothing of pyfast.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pathlib

PERIOD_US = 100_000  # CFS's default period; shorter periods add scheduler overhead per rank
V1 = pathlib.Path("/sys/fs/cgroup/cpu")
V2 = pathlib.Path("/sys/fs/cgroup")
_n = itertools.count()


class HeteroUnavailable(RuntimeError):
    """CPU caps cannot be set here (the message says why)."""


def _root() -> tuple[pathlib.Path, str]:
    """(the cpu hierarchy's root, "v1" or "v2")."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, "v1"
    ctl = V2 / "cgroup.controllers"
    if ctl.exists() and "cpu" in ctl.read_text().split():
        return V2, "v2"
    raise HeteroUnavailable("no cgroup cpu controller (neither /sys/fs/cgroup/cpu/cpu.cfs_quota_us "
                            "nor 'cpu' in /sys/fs/cgroup/cgroup.controllers)")


def available() -> str:
    """"" where throttle() can run, else why not."""
    if os.geteuid() != 0:
        return "CPU caps need root (cgroup writes)"
    try:
        _root()
    except HeteroUnavailable as e:
        return str(e)
    return ""


def _sweep(root: pathlib.Path) -> None:
    """Remove empty pyfast_* groups of processes that are gone."""
    for d in root.glob("pyfast_*"):
        pid = d.name.split("_")[1]
        if pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                d.rmdir()


@contextlib.contextmanager
def throttle(share: float, pid: int | None = None):
    """Cap process `pid` (default: this one, every thread) at `share` CPUs (0 < share; 0.5 =
    half a core, 2 = two cores) for the block. HeteroUnavailable where it cannot."""
    if not share > 0:
        raise ValueError(f"share must be > 0 CPUs, got {share}")
    why = available()
    if why:
        raise HeteroUnavailable(why)
    root, kind = _root()
    _sweep(root)
    pid = os.getpid() if pid is None else pid
    d = root / f"pyfast_{pid}_{next(_n)}"
    d.mkdir()
    quota = max(1000, round(share * PERIOD_US))  # the kernel's floor is 1 ms
    try:
        if kind == "v1":
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        (d / "cgroup.procs").write_text(str(pid))
        yield d
    finally:
        # back to the parent group (every thread moves with the process), then remove ours
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            d.rmdir()


_held: list = []  # hold()'s context managers: one collected would lift its cap (its finally)


def hold(share: float) -> pathlib.Path:
    """throttle(share) for the rest of this process's life (a rank's entry point). A bare
    `throttle(share).__enter__()` is not that: once the object is collected its generator's
    finally lifts the cap."""
    cm = throttle(share)
    group = cm.__enter__()
    _held.append(cm)
    atexit.register(cm.__exit__, None, None, None)  # the group removed, not left to _sweep
    return group


def throttled_usage(group: pathlib.Path) -> tuple[int, int]:
    """(periods throttled, total periods) of a group made by throttle(): evidence that the cap
    bit (v1 cpu.stat nr_throttled / nr_periods; v2 the same keys)."""
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines()
                if len(line.split()) == 2)
    return int(stat.get("nr_throttled", 0)), int(stat.get("nr_periods", 0))
