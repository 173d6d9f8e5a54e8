"""The launching side of `pyfast ablate`: the matrix's cells, link by link, each link's cells in
one launch of the ranks (pyfast.netns: a fresh rate-limited namespace per launch);
results.csv grows by one row as each cell finishes, so an interrupted ablation loses at most the
running cell and --resume skips every finished one (done or diverged; failed and skipped cells
are tried again).

A rank that dies fails its cell ("failed", with the error's last line) and the link's remaining
cells start again in a new launch; a cell that finishes no step for --timeout seconds is failed
the same way. Cells on a link that cannot be emulated here (not root, no iproute2) are written
as "skipped" with the reason, never run on plain loopback instead.
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import re
import time

from pyfast._io import atomic_write_text
from pyfast import netns

from .config import AblateConfig, AblateError, cells, to_json
from .schema import COLUMNS, read_rows

FINAL = ("done", "diverged")  # what --resume keeps; "failed" and "skipped" cells run again
ENTRY = ["-c", "from pyfast.ablate.cell import serve; serve()"]
# The token bucket of the ablation's links: two 64 KB lo segments, not the benchmarks' 512 KB.
# A cell sends ~0.55 MB a step (gpt-tiny, bf16) with ~30 ms of compute between steps, and a
# 512 KB bucket refilled in that gap let most of it through at memory speed (measured, 100
# Mbit/s: bf16 step 44.6 ms, 10 ms of it exposed, against 44 ms of wire time); with 128 KB the
# link is the link (73 ms, 38.5 ms exposed).
BURST = "128kb"


def _append(out: str, row: dict) -> None:
    path = os.path.join(out, "results.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore", restval="")
        if new:
            w.writeheader()
        w.writerow({k: _fmt(v) for k, v in row.items()})
        f.flush()
        os.fsync(f.fileno())  # a row written is a cell kept, whatever happens next


def _fmt(v):
    return f"{v:.6g}" if isinstance(v, float) else v


def _prepare(cfg: AblateConfig) -> set:
    """The cells already done (resume), after checking DIR may be used."""
    os.makedirs(os.path.join(cfg.out, "cells"), exist_ok=True)
    meta = os.path.join(cfg.out, "ablate.json")
    have = read_rows(cfg.out)
    if os.path.exists(meta) or have:
        if not cfg.resume:
            raise AblateError(f"{cfg.out} already holds an ablation ({len(have)} cells done): "
                              "pass --resume to continue it, or choose another --out")
        with open(meta) as f:
            old = json.load(f)["fixed"]
        if old != cfg.fixed():
            diff = {k: (old.get(k), v) for k, v in cfg.fixed().items() if old.get(k) != v}
            raise AblateError(f"--resume: {cfg.out} was run with other settings (was, now): "
                              f"{diff}; its cells would not compare")
    atomic_write_text(meta, json.dumps({"fixed": cfg.fixed(), "config": json.loads(to_json(cfg))},
                                       indent=1))
    # a failed cell (a crash, a hang) and a skipped one (no root then) are tried again
    keep = [r for r in have if r["status"] in FINAL]
    if len(keep) < len(have):
        _rewrite(cfg.out, keep)
    return {r["cell"] for r in keep}


def _rewrite(out: str, rows: list[dict]) -> None:
    import io
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", restval="")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(os.path.join(out, "results.csv"), buf.getvalue())


class _View:
    """Rich progress: the whole matrix (steps of every cell to run, with its ETA) and the
    running cell's steps; a plain line per finished cell when stdout is not a terminal."""

    def __init__(self, todo: list[dict]):
        from rich.console import Console
        self.console = Console()
        self.bar = None
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeRemainingColumn(), console=self.console)
            self.all = self.bar.add_task(f"{len(todo)} cells", total=sum(c["steps"] for c in todo))
            self.one = self.bar.add_task("", total=1)
            self.bar.start()
        self.base = 0

    def running(self, cell: dict, step: int) -> None:
        if self.bar:
            self.bar.update(self.one, description=cell["cell"], total=cell["steps"], completed=step)
            self.bar.update(self.all, completed=self.base + step)

    def finished(self, cell: dict, row: dict) -> None:
        self.base += cell["steps"]
        tt = row.get("time_to_target_s")
        what = (f"target in {float(tt):.1f} s" if tt not in ("", None) else "target not reached") \
            if row["status"] == "done" else f"{row['status']}: {row.get('reason', '')}"
        self.console.print(f"{cell['cell']}: {what}")
        if self.bar:
            self.bar.update(self.all, completed=self.base)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def _lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _launch(cfg: AblateConfig, link: str, world: int, todo: list[dict], view, finish) -> None:
    """Run `todo` (one link and world size) in launches of the ranks until each has a row."""
    job = {"dir": os.path.abspath(cfg.out), "timeout": cfg.timeout, "batch": cfg.batch,
           "seq": cfg.seq, "lr": cfg.lr, "scratch": os.path.abspath(os.path.join(cfg.out, "tmp"))}
    while todo:
        env = {"PYFAST_ABLATE": json.dumps({**job, "cells": todo})}
        for c in todo:  # a stale row of an interrupted run must not count as this run's
            for ext in (".json", ".jsonl"):
                p = os.path.join(cfg.out, "cells", c["cell"] + ext)
                if os.path.exists(p):
                    os.remove(p)
        with netns.ranks(ENTRY, world, link, timeout=cfg.timeout * (len(todo) + 1),
                         env=env, burst=BURST) as launch:
            last, seen = time.monotonic(), -1
            while todo:
                done = os.path.join(cfg.out, "cells", todo[0]["cell"] + ".json")
                if os.path.exists(done):
                    with open(done) as f:
                        finish(todo.pop(0), json.load(f))
                    last, seen = time.monotonic(), -1
                    continue
                n = _lines(done + "l")
                if n != seen:
                    seen, last = n, time.monotonic()
                    view.running(todo[0], n)
                dead = [p for p in launch.procs if p.poll() is not None]
                if dead or time.monotonic() - last > cfg.timeout:
                    if not os.path.exists(done):  # not a rank exiting just after the last row
                        finish(todo.pop(0), {"status": "failed", "reason": _why(launch, dead,
                                                                               cfg.timeout)})
                    break
                time.sleep(0.2)


def _why(launch, dead, timeout: float) -> str:
    if not dead:
        return f"no step finished for {timeout:.0f} s (--timeout)"
    try:
        launch.wait()
    except RuntimeError as e:  # "ranks failed, exit codes [...]" + each failed rank's stderr
        lines = str(e).splitlines()
        errors = [ln.strip() for ln in lines if re.search(r"\w+(Error|Exception|Interrupt)\b", ln)]
        return "; ".join([lines[0]] + errors[-1:])[:300]
    return "the ranks exited before the cell's row was written"


def run(cfg: AblateConfig) -> str:
    """Run every cell not done yet; returns DIR. Writes the report at the end."""
    done = _prepare(cfg)
    todo = [c for c in cells(cfg) if c["cell"] not in done]
    why = netns.unavailable()
    view = _View(todo)

    def finish(cell: dict, row: dict) -> None:
        full = {**cell, **row}
        _append(cfg.out, full)
        view.finished(cell, full)

    try:
        for (link, world), group in itertools.groupby(todo, key=lambda c: (c["link"], c["world"])):
            group = list(group)
            if netns.rate_bps(link) is not None and why:
                view.console.print(f"[yellow]link {link}: {why}; its {len(group)} cells are "
                                   "skipped[/yellow]")
                for c in group:
                    finish(c, {"status": "skipped", "reason": why})
                continue
            _launch(cfg, link, world, group, view, finish)
    finally:
        view.close()
    from . import report
    report.write(cfg.out)
    return cfg.out
