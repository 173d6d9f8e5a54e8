"""DiLoCo against data parallelism across a slow link (`pyfast bench diloco`): the same tokens
(global batch, steps, seed) through `pyfast train` on a namespace-shaped link (pyfast.netns: tc
tbf on the namespace's lo), R replicas x 1 rank (R4: 4 ranks on this machine's 2 cores) against
data parallelism on 2 ranks (on 4 ranks it would send 3x the bytes: 2 ranks is the harder
reference):

  dp bf16, dp int8         --dp 2 --compress bf16 / int8 (a reduction every step)
  diloco H10, H50          --diloco H --replicas 2 (fp32 outer gradients)
  streaming fp32/int8/int4/e3m0
                           --diloco 40 --replicas 2 --fragments 4 --diloco-delay 2
                           --outer-compress none / int8 / int4 / e3m0
  streaming int4 R4/H20/H80
                           the same int4 with 4 replicas, or H = 20 / 80

Every run has the same global batch, seed and learning-rate schedule (--lr-schedule): a 20-step
warm-up, then cosine down to 0.1 x lr at step N (dp) or --diloco-decay K x N (DiLoCo; K = 1:
dp's schedule), constant after it; or constant (the schedules before issue 32). The schedule
does not depend on a run's length (--lr-decay-steps), so the first N steps of a longer run are
the N-step run: the data-parallel runs take N steps, the DiLoCo ones up to LONGER x N (they stop
at the first validation at or below dp bf16's final loss on that link and model, or at LONGER x
N). DiLoCo runs validate the replicas' own parameters (their mean loss) and the outer ones
(--eval-outer); --eval picks the curve they are judged by.

Per run: the validation loss every --eval-every steps against the training time so far (the
steps' own step_ms: validation and checkpoints left out); the time to dp bf16's final
validation loss on the same link and model and the speed-up over dp bf16's own; the validation
loss at step N (equal tokens); bytes on the wire (the namespace's lo tx counter over the whole
run: startup broadcasts included); peak link bandwidth (the most bytes lo sent in any 100 ms
window, sampled from /proc/PID/net/dev of a rank inside the namespace); compute utilization
(sum of the steps' compute_ms / sum of step_ms: compute_ms leaves out waiting on the per-step
all-reduce and, for DiLoCo, the outer step's time beyond a plain inner step). The bandwidth a
schedule needs (need MB/s): the most bytes one step has to move (all ranks: dp's reduction; an
outer all-reduce, R (R - 1) x rank 0's compressed pseudo-gradient) over the compute time it may
hide behind (the median step's compute; tau + 1 steps for Streaming DiLoCo): what the paper's
peak-bandwidth comparison measures. A tbf link caps the measured 100 ms peak at its own rate,
so that column tells whether a link was saturated, the need column how far below the rate a
schedule could go.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pyfast
from pyfast import perf
from pyfast import netns

STREAM = ["--diloco", "40", "--replicas", "2", "--fragments", "4", "--diloco-delay", "2"]
R4 = ["--replicas", "4"]  # 4 ranks on this machine's 2 cores: two ranks a core
CONFIGS = {
    "dp bf16": ["--dp", "2", "--compress", "bf16"],
    "dp int8": ["--dp", "2", "--compress", "int8"],
    "diloco H10": ["--diloco", "10", "--replicas", "2"],
    "diloco H50": ["--diloco", "50", "--replicas", "2"],
    "streaming fp32": STREAM + ["--outer-compress", "none"],
    "streaming int8": STREAM + ["--outer-compress", "int8"],
    "streaming int4": STREAM + ["--outer-compress", "int4"],
    "streaming e3m0": STREAM + ["--outer-compress", "e3m0"],  # the paper's 4-bit format
    # the levers of issue 32: more replicas (the same global batch, a quarter each), H
    "streaming int4 R4": STREAM + R4 + ["--outer-compress", "int4"],
    "streaming int4 H20": STREAM + ["--diloco", "20", "--outer-compress", "int4"],
    "streaming int4 H80": STREAM + ["--diloco", "80", "--outer-compress", "int4"],
    # issue 32, second session: a smaller H (a fragment every 2 steps, overlapping 1)
    "streaming int4 H8": STREAM + ["--diloco", "8", "--diloco-delay", "1", "--outer-compress",
                                   "int4"],
}
REFERENCE = "dp bf16"
LONGER = 3  # DiLoCo runs may take up to this many times the reference's tokens to reach it
# the learning rate: a linear warm-up over 20 steps, then constant, or cosine down to 0.1 x lr at
# step `decay` x N (dp: N) and constant after it (--lr-decay-steps: the schedule does not depend
# on a run's length, so the first N steps of a longer run are the N-step run in both)
WARMUP = ["--warmup", "20"]
SCHEDULES = ("cosine", "constant")


def schedule_flags(name: str, n: int, decay: float, diloco: bool) -> list[str]:
    if name == "constant":
        return WARMUP + ["--min-lr-ratio", "1"]
    if name != "cosine":
        raise ValueError(f"pyfast bench diloco: --lr-schedule {name!r}: one of {SCHEDULES}")
    return WARMUP + ["--min-lr-ratio", "0.1",
                     "--lr-decay-steps", str(round(n * (decay if diloco else 1)))]


def _flag(flags: list[str], name: str, default: int) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else default
# model: (seq, global batch, steps, eval every): steps a multiple of every H (10, 40, 50)
SIZES = {"gpt-tiny": (64, 16, 200, 20), "gpt-small": (128, 8, 200, 20)}
LINKS = ("100mbit", "1gbit")
WINDOW_S = 0.1  # peak bandwidth: the most bytes in any window this long


def _lo_tx(pid: int, ns: int) -> int | None:
    """lo's tx bytes in the network namespace of process pid, None unless pid is in namespace
    inode `ns` (before `ip netns exec` has entered it, or once the process is gone)."""
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino != ns:
            return None
        with open(f"/proc/{pid}/net/dev") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        iface, _, data = line.partition(":")
        if iface.strip() == "lo":
            return int(data.split()[8])
    return None


class Sampler(threading.Thread):
    """lo's tx counter of pid's namespace every WINDOW_S / 4 s: total and peak bytes per
    WINDOW_S (a sliding window over the samples)."""

    def __init__(self, pid: int, ns: int):
        super().__init__(daemon=True)
        self.pid, self.ns, self.samples, self.stop = pid, ns, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            v = _lo_tx(self.pid, self.ns)
            if v is not None:
                self.samples.append((time.monotonic(), v))
            self.stop.wait(WINDOW_S / 4)

    def peak(self) -> float:
        s = self.samples
        if len(s) < 2:
            return math.nan
        peak, j = 0, 0
        for i in range(len(s)):  # the most bytes within WINDOW_S after each sample
            while j + 1 < len(s) and s[j + 1][0] - s[i][0] <= WINDOW_S:
                j += 1
            peak = max(peak, s[j][1] - s[i][1])
        return peak / WINDOW_S


def measure(link: str, model: str, config: str, size, timeout: float = 1800,
            target: float | None = None, schedule: str = "cosine", decay: float = 1.0,
            evaluate: str = "local") -> dict:
    """One `pyfast train` (replicas x dp ranks) on `link`: its curve, bytes and times. target:
    run up to LONGER x the steps, stopping at the first validation loss <= target (SIGTERM to
    the job, the metrics of the steps done kept). DiLoCo runs validate both the replicas' own
    parameters (their mean loss) and the outer ones; `evaluate` picks the curve they are
    judged by (local or outer: the averaged parameters the outer optimizer holds)."""
    seq, batch, steps, every = size
    flags = CONFIGS[config]
    diloco = "--diloco" in flags
    nproc = _flag(flags, "--replicas", 1) * _flag(flags, "--dp", 1)
    n = steps if target is None else LONGER * steps
    key = "val_loss_outer" if evaluate == "outer" and "--diloco" in CONFIGS[config] \
        else "val_loss"
    if netns.rate_bps(link) is None:
        raise ValueError("pyfast bench diloco: the links are namespace-shaped (100mbit, "
                         "1gbit, ...): loopback's counters are the machine's")
    with tempfile.TemporaryDirectory() as out, netns.link_prefix(link) as pre:
        cmd = [sys.executable, "-m", "pyfast", "train", "--nproc", str(nproc), "--model", model,
               "--seq", str(seq), "--batch", str(batch), "--steps", str(n),
               "--eval-every", str(every), "--eval-batches", "2", "--seed", "0",
               "--no-tensorboard", "--no-plot", "--out", out,
               *schedule_flags(schedule, steps, decay, diloco),
               *flags, *(["--eval-outer"] if diloco else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        log = open(os.path.join(out, "log.txt"), "w+")  # a file: a pipe nobody reads fills
        p = subprocess.Popen(pre + cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
        # `ip netns exec` execs the command: p.pid enters the namespace
        sampler = Sampler(p.pid, os.stat(f"/run/netns/{pre[3]}").st_ino)
        sampler.start()
        metrics, stopped = os.path.join(out, "metrics.jsonl"), False
        try:
            while p.poll() is None:
                if time.monotonic() - t0 > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                if target is not None and _reached(metrics, target, key):
                    stopped = True
                    break
                time.sleep(0.2)
        finally:
            sampler.stop.set()
            _stop(p)
            log.seek(0)
            err = log.read()
            log.close()
        wall = time.monotonic() - t0
        left = [q for q in _ranks_of(out) if q != os.getpid()]
        for q in left:  # counted (the smoke test requires none), then ended
            with contextlib.suppress(ProcessLookupError):
                os.kill(q, signal.SIGKILL)
        wire = netns.lo_tx_bytes(pre[3])  # a fresh namespace's lo starts at 0
        if p.returncode != 0 and not stopped:
            raise RuntimeError(f"{' '.join(cmd)} on {link}: exit {p.returncode}\n{err[-2000:]}")
        recs = _read(metrics)
    peak = sampler.peak()
    t, curve, local = 0.0, [], []
    for r in recs:
        t += r["step_ms"] / 1e3
        if "val_loss" in r:
            curve.append((r["step"], t, r[key]))
            local.append((r["step"], t, r["val_loss"]))
    step_s = sum(r["step_ms"] for r in recs) / 1e3
    compute_s = sum(r["compute_ms"] for r in recs) / 1e3
    outer = sum(r.get("outer_payload_bytes", 0) for r in recs)
    syncs = sum(r.get("outer_sent") is not None for r in recs)
    # the bandwidth that would hide the traffic: a step's bytes (all ranks) within the compute
    # of the steps it may run behind (1 for dp; tau + 1 for an outer all-reduce: each of the 2
    # replicas sends its compressed pseudo-gradient to the other once)
    compute = sorted(r["compute_ms"] for r in recs)[len(recs) // 2] / 1e3
    tau, R = _flag(flags, "--diloco-delay", 0), _flag(flags, "--replicas", 1)
    # an outer all-reduce: each of R replicas' compressed pseudo-gradient to the R - 1 others
    moved = [R * (R - 1) * r["outer_payload_bytes"] if "outer_payload_bytes" in r
             else r["bytes_sent"] for r in recs]
    need = max(moved) / ((tau + 1) * compute)
    at_n = next((v for s, _, v in curve if s == steps), math.nan)
    return {"link": link, "model": model, "config": config, "steps": len(recs),
            "tokens": len(recs) * batch * seq, "train_s": step_s, "wall_s": wall,
            "final_val": curve[-1][2], "val_at_n": at_n, "curve": curve, "curve_local": local,
            "evaluated": key, "ranks": nproc, "bytes_sent": sum(r["bytes_sent"] for r in recs),
            "replicas_bytes_sent": sum(r.get("replicas_bytes_sent", 0) for r in recs),
            "wire_bytes": wire, "left_running": len(left),
            "peak_Bps": peak, "need_Bps": need, "max_step_bytes": max(moved),
            "utilization": compute_s / step_s,
            "outer_payload_bytes_rank0": outer, "outer_syncs": syncs}


def _read(path: str) -> list[dict]:
    """The complete lines of a metrics log (the job may be writing the next one)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1] if line]


def _ranks_of(out: str) -> list[int]:
    """Processes whose command line names the run's own (temporary, unique) out folder (a
    forked rank's title, "pyfast rank R/W: train ... --out OUT", names it too)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if d.isdigit() and out.encode() in f.read():
                    pids.append(int(d))
        except OSError:
            continue
    return pids


def _stop(p: subprocess.Popen) -> None:
    """SIGTERM to the job, then its group killed. torchrun starts each exec'd rank in a session
    of its own, so a SIGKILL to the launcher's group alone left the ranks training on (seen
    2026-11-28: a stopped run's two ranks at 45% CPU each, normal priority, through the next
    config's timed run); on SIGTERM torchrun stops its ranks itself. (Forked ranks, the
    default since, die with their launcher: pyfast.train.launch.)"""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=60)
    netns._kill([p])


def _reached(path: str, target: float, key: str = "val_loss") -> bool:
    return any(r.get(key, math.inf) <= target for r in _read(path))


def summarize(rows: list[dict]) -> None:
    """Each row's time to its link's and model's dp bf16 final validation loss (None: never
    reached within the run) and its speed-up over dp bf16 there."""
    for r in rows:
        ref = next((q for q in rows if q["link"] == r["link"] and q["model"] == r["model"]
                    and q["config"] == REFERENCE), None)
        if ref is None:
            continue
        target = ref["final_val"]
        hit = next(((s, t) for s, t, v in r["curve"] if v <= target), None)
        r["target_val"] = target
        r["time_to_target_s"], r["steps_to_target"] = (hit[1], hit[0]) if hit else (None, None)
        r["speedup"] = ref["train_s"] / hit[1] if hit else None
        r["val_vs_ref"] = r["val_at_n"] / target - 1
        # the other parameters' curve too (DiLoCo: the replicas' own when judged on the outer)
        local = next((t for _, t, v in r.get("curve_local", ()) if v <= target), None)
        r["speedup_local"] = ref["train_s"] / local if local else None
        at_n = next((v for s, _, v in r.get("curve_local", ()) if s == ref["steps"]), math.nan)
        r["val_vs_ref_local"] = at_n / target - 1


def run(links=LINKS, models=("gpt-tiny",), configs=tuple(CONFIGS), sizes=None,
        timeout: float = 1800, schedule: str = "cosine", decay: float = 1.0,
        evaluate: str = "local", reference: dict | None = None) -> dict:
    """reference: an earlier result whose dp bf16 rows (same link, model, sizes and schedule)
    stand in for measuring dp bf16 again (at 100 Mbit/s gpt-small's takes 12 minutes)."""
    t_start, load = time.monotonic(), os.getloadavg()[0]
    sizes = {**SIZES, **(sizes or {})}
    rows, skipped = [], []
    for link in links:
        netns.rate_bps(link)
        for model in models:
            target = None
            if reference is not None:
                ref = _reference(reference, link, model, sizes[model], schedule)
                rows.append(ref)
                target = ref["final_val"]
                configs = [c for c in configs if c != REFERENCE]
            for config in sorted(configs, key=lambda c: c != REFERENCE):  # the reference first
                try:
                    rows.append(measure(link, model, config, sizes[model], timeout,
                                        target if config != REFERENCE else None,
                                        schedule, decay, evaluate))
                    if config == REFERENCE:
                        target = rows[-1]["final_val"]
                except netns.LinkUnavailable as e:
                    skipped.append({"link": link, "skipped": str(e)})
                    break
            else:
                continue
            break
    summarize(rows)
    return {"machine": perf.machine(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "sizes": {m: sizes[m] for m in models},
            "schedule": schedule, "decay": decay, "evaluate": evaluate,
            "rows": rows, "skipped": skipped, "load_before": load,
            "wall_s": time.monotonic() - t_start}


def _reference(result: dict, link: str, model: str, size, schedule: str) -> dict:
    row = next((r for r in result["rows"] if r["config"] == REFERENCE and r["link"] == link
                and r["model"] == model), None)
    if row is None:
        raise ValueError(f"pyfast bench diloco --reference: no {REFERENCE} row for {link}, "
                         f"{model} in it")
    theirs = (list(result["sizes"][model]), result.get("schedule", "constant"))
    if theirs != (list(size), schedule):
        raise ValueError(f"pyfast bench diloco --reference: its {model} run had (seq, batch, "
                         f"steps, eval every), lr schedule {theirs}; this one {(list(size), schedule)}")
    return {**row, "measured": result["date"]}


def _own(r: dict) -> str:
    """A DiLoCo row judged on its outer parameters: the same two numbers on its own ones."""
    if r.get("evaluated") != "val_loss_outer" or "val_vs_ref_local" not in r:
        return "-"
    up = f"{r['speedup_local']:.1f}x" if r.get("speedup_local") else "-"
    return f"{up}, {r['val_vs_ref_local']:+.2%}"


def _mb(b) -> str:
    return f"{b / 1e6:.1f}"


def crossings(result: dict) -> list[tuple]:
    """(link, model, n, dp bf16's loss at step n, {config: its speed-up to that loss or None})
    for every validation of dp bf16: how the time-to-loss ratio moves as training goes on (a
    single final loss hides that DiLoCo's lead can shrink: its replicas each see half the batch
    at the same learning rate)."""
    out = []
    for ref in (r for r in result["rows"] if r["config"] == REFERENCE):
        others = [r for r in result["rows"] if r["config"] != REFERENCE
                  and (r["link"], r["model"]) == (ref["link"], ref["model"])]
        for n, t_ref, v_ref in ref["curve"]:
            ups = {}
            for r in others:
                hit = next((t for _, t, v in r["curve"] if v <= v_ref), None)
                ups[r["config"]] = t_ref / hit if hit else None
            out.append((ref["link"], ref["model"], n, v_ref, ups))
    return out


def _crossing_table(result: dict):
    rows = crossings(result)
    configs = sorted({c for *_, ups in rows for c in ups}, key=list(CONFIGS).index)
    t = perf.rich_table("Speed-up to dp bf16's validation loss at its step n (time there / "
                        "the first time a DiLoCo run is at or below it; - : not within "
                        f"{LONGER} N steps)", result,
                        ("link", "model", "dp step n", "dp bf16 val", *configs),
                        left=("link", "model"))
    for link, model, n, v, ups in rows:
        t.add_row(link, model, str(n), f"{v:.4f}",
                  *[f"{ups[c]:.2f}x" if ups.get(c) else "-" for c in configs])
    return t


def table(result: dict):
    """The main table, then the speed-up at every dp bf16 validation (crossings)."""
    from rich.console import Group
    main = _main_table(result)
    return Group(main, _crossing_table(result)) if crossings(result) else main


def _main_table(result: dict):
    sizes = ", ".join(f"{m}: seq {s[0]}, batch {s[1]}, N = {s[2]} steps" for m, s in
                      result["sizes"].items())
    lr = (f"cosine lr to step N (DiLoCo: {result.get('decay', 1):g} N)"
          if result.get("schedule", "constant") == "cosine" else "constant lr")
    t = perf.rich_table(f"DiLoCo vs data parallelism, 2 ranks (R4: 4 ranks on 2 cores), replicas "
                        f"x 1 rank ({sizes}; {lr}; DiLoCo judged on its "
                        f"{result.get('evaluate', 'local')} parameters, up to {LONGER} N steps, "
                        "to dp bf16's final validation loss)",
                        result, ("link", "model", "config", "to dp-bf16 loss s", "steps",
                                 "speed-up", "val @ N", "vs dp bf16",
                                 "own params: speed-up, vs dp", "wire MB",
                                 "peak MB/s", "max MB/step", "need MB/s", "compute util",
                                 "syncs"),
                        left=("link", "model", "config"))
    for r in result["rows"]:
        hit = r.get("time_to_target_s")
        t.add_row(r["link"], r["model"], r["config"] + (f" ({r['measured'][:16]})"
                                                        if "measured" in r else ""),
                  f"{hit:.1f}" if hit else f"> {r['train_s']:.1f}",
                  str(r["steps_to_target"] or f"> {r['steps']}"),
                  f"{r['speedup']:.1f}x" if r.get("speedup") else "-",
                  f"{r['val_at_n']:.4f}",
                  f"{r['val_vs_ref']:+.2%}" if "val_vs_ref" in r else "-",
                  _own(r),
                  _mb(r["wire_bytes"]), _mb(r["peak_Bps"]) if math.isfinite(r["peak_Bps"])
                  else "-", _mb(r["max_step_bytes"]), _mb(r["need_Bps"]),
                  f"{r['utilization']:.0%}", str(r["outer_syncs"] or "-"))
    for s in result["skipped"]:
        t.add_row(s["link"], "-", f"skipped: {s['skipped']}", *[""] * 12)
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench diloco", description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--models", default="gpt-tiny,gpt-small")
    p.add_argument("--configs", default="", help="only these, comma-separated (dp bf16, the "
                   "reference, is needed for the time-to-loss columns)")
    p.add_argument("--steps", type=int, default=0, help="steps of every run (default per "
                   "model: 200; a multiple of 200 keeps every H's last sync at the end)")
    p.add_argument("--lr-schedule", default="cosine", choices=SCHEDULES)
    p.add_argument("--diloco-decay", type=float, default=1.0, metavar="K",
                   help="cosine: DiLoCo's decays over K x N steps (dp's over N; default 1: the "
                   "same schedule)")
    p.add_argument("--eval", default="local", choices=("local", "outer"),
                   help="which DiLoCo parameters are validated against dp: the outer (global) "
                   "ones or the replicas' own (their mean loss)")
    p.add_argument("--reference", default="", metavar="JSON",
                   help="take dp bf16's rows from this earlier result (same sizes and schedule) "
                   "instead of measuring them again")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    models = a.models.split(",")
    unknown = [m for m in models if m not in SIZES]
    configs = [c.strip() for c in a.configs.split(",") if c.strip()] or list(CONFIGS)
    bad = [c for c in configs if c not in CONFIGS]
    if unknown or bad:
        p.error(f"unknown models {unknown} or configs {bad}; known: {list(SIZES)}, "
                f"{list(CONFIGS)}")
    sizes = {m: (*SIZES[m][:2], a.steps, SIZES[m][3]) for m in models} if a.steps else None
    return perf.finish(run(a.links.split(","), models, configs, sizes, schedule=a.lr_schedule,
                           decay=a.diloco_decay, evaluate=a.eval,
                           reference=_load(a.reference) if a.reference else None),
                       table, a.out, width=170)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    raise SystemExit(main())
