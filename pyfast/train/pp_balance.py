"""`pyfast train --pp-balance even|auto|C0,C1,...`: speed-weighted pipeline stages (issue 36;
user guide docs/hetero.md). The flag, its checks, what the job passes to
Pipeline.from_sequential(stage_costs=...), and what it reports: the layer counts chosen (at
start and in the run summary) and each stage's idle fraction per step (metrics.jsonl
"pp_idle", the pipeline's bubble as its ranks saw it). No torch import at module level
(config.py parses flags without torch).

    even        every rank as fast as the others (the cut of --pp alone; the default)
    auto        each pp rank times a 0.5 s matmul probe of the model's largest Linear at start
                (pyfast.parallel.stage_costs): costs = time / fastest. The dry run has no
                speed to measure: there auto runs as even, with a printed note
    C0,C1,...   one relative cost per pp rank (2 = half as fast), e.g. 1,2
"""
from __future__ import annotations

import argparse
import math
import statistics

MODES = ("even", "auto")


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("mixed hardware (--pp > 1)")
    g.add_argument("--pp-balance", default=d.pp_balance, metavar="even|auto|C0,C1,...",
                   help="layers per pipeline stage by each pp rank's speed: even (all alike), "
                        "auto (each rank times a 0.5 s matmul probe at start; a dry run "
                        "treats it as even, with a note), or one relative cost per pp rank "
                        "(2 = half as fast: fewer layers)")


def costs(spec: str) -> list[float] | None:
    """The relative costs of a C0,C1,... spec; None for even/auto. ValueError if unreadable."""
    if spec in MODES:
        return None
    return [float(c) for c in spec.split(",")]


def problem(cfg) -> str | None:
    """What is wrong with --pp-balance, told by flag; None if nothing (config.check raises it)."""
    spec = cfg.pp_balance
    if spec == "even":
        return None
    if cfg.pp == 1:
        return f"--pp-balance {spec} weighs pipeline stages: it needs --pp > 1"
    try:
        got = costs(spec)
    except ValueError:
        return f"--pp-balance {spec!r}: even, auto, or one number per pp rank (e.g. 1,2)"
    if got is None:
        return None
    if len(got) != cfg.pp:
        return (f"--pp-balance {spec}: {len(got)} costs for --pp {cfg.pp}: one relative cost "
                "per pp rank")
    if not all(math.isfinite(c) and c > 0 for c in got):
        return f"--pp-balance {spec}: costs must be finite and > 0 (2 = half as fast)"
    return None


def stage_costs(cfg, device):
    """Pipeline.from_sequential's stage_costs: None (even), "measure" (auto; even on the
    meta device of a dry run: note() says so) or the list."""
    if cfg.pp_balance == "auto":
        return None if device.type == "meta" else "measure"
    return costs(cfg.pp_balance)


def note(cfg, device) -> str | None:
    if cfg.pp_balance == "auto" and device.type == "meta":
        return ("--pp-balance auto: a dry run has no speed to measure; its stages are the "
                "even cut (--pp-balance C0,C1,... sizes a weighted cut)")
    return None


def describe(job) -> str | None:
    """The start line: layers per stage, and the costs that chose them."""
    pipe = job.pipe
    if pipe is None:
        return None
    counts = [pipe.bounds[s + 1] - pipe.bounds[s] for s in range(pipe.n_stages)]
    line = f"pipeline stages: {','.join(map(str, counts))} layers"
    if pipe.stage_costs is not None:
        line += (f", pp rank costs {','.join(f'{c:.2f}' for c in pipe.stage_costs)} "
                 f"(--pp-balance {job.cfg.pp_balance}")
        if pipe.probe_s is not None:
            line += ": probe ms per matmul " + ",".join(f"{1e3 * s:.2f}" for s in pipe.probe_s)
        line += ")"
    return line + (f"; {note(job.cfg, job.device)}" if note(job.cfg, job.device) else "")


def idle_slots(job, idle_s: float, wall_s: float):
    """This rank's idle fraction in its pp slot of a pp-vector (zeros elsewhere, and on every
    rank but tp, dp and cp rank 0: one contributor per stage), for the step's all-reduce."""
    import torch
    m, v = job.mesh, torch.zeros(job.cfg.pp, dtype=torch.float64, device=job.device)
    if m.tp_rank == 0 and m.dp_rank == 0 and m.cp_rank == 0 and wall_s > 0:
        v[m.pp_rank] = idle_s / wall_s
    return v


def summary_rows(job, records: list[dict]) -> list[tuple[str, str]]:
    """The run summary's rows: layers per stage and the median idle fraction of each."""
    line = describe(job)
    if line is None:
        return []
    rows = [("pipeline layers per stage", line.split(": ", 1)[1])]
    idle = [r["pp_idle"] for r in (records[1:] or records) if "pp_idle" in r]
    if idle:
        med = [statistics.median(s) for s in zip(*idle)]
        rows.append(("pipeline idle per stage (median; the bubble)",
                     ", ".join(f"{100 * f:.0f}%" for f in med)))
    return rows
