"""`pyfast train --profile START:END`: torch.profiler over the job's steps START..END-1 (user
guide docs/profiling.md). Kept here so config.py and run.py grow by a line or two each; no
torch import at module level (config.py parses flags without torch).

What it writes, per rank, under RUN_DIR/profile/:
- rank<R>.<ns>.pt.trace.json: the Chrome/Perfetto trace (torch.profiler.tensorboard_trace_handler's
  layout: `tensorboard --logdir RUN_DIR/profile` opens it in the profiler plugin; ui.perfetto.dev
  and chrome://tracing read the file as it is). CPU activity on every thread (the communication
  thread's collectives too: profile_all_threads), and CUDA kernels where the job runs on CUDA.
  pyfast's work is in it as ranges named pyfast.<area>.<what> (pyfast._ranges), each step of
  the job as pyfast.train.step#N inside torch's ProfilerStep#N.
- split.json: every rank's per-step split (pyfast.train.profile_split: compute, exposed
  communication, codec, bubble, data, other; seconds and % of the step), gathered to rank 0,
  which also prints it after step END-1.

How the trace holds exactly steps START..END-1: the schedule is a function of the job's step
number (the profiler's step counter is set to it before the first step, so ProfilerStep#N is
step N): NONE before START-1, WARMUP during step START-1 (when the run has it: the profiler's
start-up cost lands there, not in a recorded step), RECORD for START..END-2, RECORD_AND_SAVE
for END-1, NONE after; prof.step() is called right after each step's train_step returns, so
the checkpoint and validation of step END-1 are not in the trace.

--ft: a step a quorum repeats is a second ProfilerStep (the label then runs ahead by one).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("profiling (pyfast.train.profile; docs/profiling.md)")
    g.add_argument("--profile", default=d.profile, metavar="START:END",
                   help="torch.profiler over steps START..END-1 (steps count from 1; END at "
                        "most --steps + 1): a Chrome/Perfetto trace per rank under "
                        "OUT/profile/ (TensorBoard's profiler plugin opens the folder) and the "
                        "per-step split (compute, exposed communication, codec, pipeline "
                        "bubble, data, other) printed and written to OUT/profile/split.json. "
                        "Refused by --dry-run (nothing runs there to profile)")


def window(spec: str) -> tuple[int, int]:
    """(START, END) of a --profile value; ValueError naming what is wrong."""
    parts = spec.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start, end = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"--profile {spec!r}: START:END, two integers (the steps START..END-1 "
                         "are profiled), e.g. --profile 3:5") from None
    return start, end


def problem(cfg) -> str | None:
    """What is wrong with --profile (config.check raises it as a ConfigError); None if
    nothing or if it is off."""
    if not cfg.profile:
        return None
    try:
        start, end = window(cfg.profile)
    except ValueError as e:
        return str(e)
    if start < 1:
        return f"--profile {cfg.profile}: START must be >= 1 (steps count from 1), got {start}"
    if start >= end:
        return (f"--profile {cfg.profile}: START {start} must be < END {end} (the steps "
                "START..END-1 are profiled)")
    if end > cfg.steps + 1:
        return (f"--profile {cfg.profile}: END {end} is beyond --steps {cfg.steps} (the last "
                f"step profiled would be {end - 1}; END is at most {cfg.steps + 1})")
    return None


def dry_problem(cfg) -> str | None:
    if cfg.profile:
        return (f"--dry-run with --profile {cfg.profile}: a dry run runs no kernel and no "
                "collective (meta tensors, torch's fake group) and has no time to profile; "
                "drop --profile (or run the job)")
    return None


def directory(out: str) -> str:
    return os.path.join(out, "profile")


class Profiler:
    """The profiler of one rank's job: run(job, step) runs the step inside it; close() stops
    it early (a failed run) and is idempotent."""

    def __init__(self, cfg, start: int, device, rank: int, world: int, say=print):
        import torch
        from torch.profiler import ProfilerActivity, profile
        self.start, self.end = window(cfg.profile)
        self.dir, self.rank, self.world, self.say = directory(cfg.out), rank, world, say
        self.trace: str | None = None
        self.prof = None
        if start + 1 >= self.end:  # resumed past the window
            if rank == 0:
                say(f"pyfast train: --profile {cfg.profile}: this run starts at step "
                    f"{start + 1}, after the window: nothing profiled")
            return
        acts = [ProfilerActivity.CPU]
        if device.type == "cuda" and torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=acts, schedule=self._schedule,
                            on_trace_ready=self._save, experimental_config=_all_threads())
        # ProfilerStep#N is the job's step N (module docstring)
        self.prof.step_num = start + 1
        self.prof.current_action = self._schedule(start + 1)
        if hasattr(self.prof, "_prev_schedule_action"):
            self.prof._prev_schedule_action = self.prof.current_action
        self.prof.start()

    def _schedule(self, step: int):
        from torch.profiler import ProfilerAction as A
        if step < self.start - 1 or step >= self.end:
            return A.NONE
        if step == self.start - 1:
            return A.WARMUP
        return A.RECORD_AND_SAVE if step == self.end - 1 else A.RECORD

    def _save(self, prof) -> None:
        os.makedirs(self.dir, exist_ok=True)
        # tensorboard_trace_handler's file name: <worker>.<ns>.pt.trace.json
        path = os.path.join(self.dir, f"rank{self.rank}.{time.time_ns()}.pt.trace.json")
        prof.export_chrome_trace(path)
        self.trace = path

    def run(self, job, step: int) -> dict:
        """job.train_step(step) as the range pyfast.train.step#<step>, then the profiler's
        step; after step END-1, the split (every rank takes part: a gather)."""
        if self.prof is None:
            return job.train_step(step)
        from torch.autograd.profiler import record_function
        with record_function(f"pyfast.train.step#{step}"):
            rec = job.train_step(step)
        self.prof.step()
        if self.trace is not None and self.prof is not None:
            self._report()
        return rec

    def _report(self) -> None:
        import torch.distributed as dist
        from . import profile_split as S
        self.close()
        with open(self.trace) as f:
            steps = S.split(json.load(f))
        mine = {"rank": self.rank, "trace": self.trace, "steps": steps, "mean": S.mean(steps)}
        every = [None] * self.world
        dist.all_gather_object(every, mine)
        if self.rank != 0:
            return
        out = {"window": [self.start, self.end], "parts": list(S.PARTS), "ranks": every,
               "how": "pyfast.train.profile_split: each instant of pyfast.train.step#N on the "
                      "training thread goes to the first of parts (in this order) covering it"}
        path = os.path.join(self.dir, "split.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".tmp", path)
        self.say(f"pyfast train: profile of steps {self.start}..{self.end - 1} (ms and % of "
                 f"each step; comm: exposed communication):\n{S.table(every)}\n"
                 f"traces: {self.dir} (tensorboard --logdir {self.dir}, or ui.perfetto.dev); "
                 f"split: {path}")
        sys.stdout.flush()

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()


def _all_threads():
    """Kineto's config recording every thread (the communication thread's ranges), where this
    torch has the option (2.6+; without it the FIFO worker's collectives are missing)."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None
