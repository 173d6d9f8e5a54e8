"""Calibration probe of the job's own per-step cost beyond modules and optimizer
(pyfast.plan.calibrate)."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload, gpt_model_flag
from . import timing
from .calibrate_link import _child, _finish


def job_probe(path: str, model: str, seq: int, batch: int, precision: str, steps: int = 8) -> None:
    """One rank (world 1) of pyfast's Job at this local batch: its median step seconds after
    3 warm-up steps, written as JSON to `path` (measure_job_overhead's child process)."""
    import datetime
    import torch
    import torch.distributed as dist
    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    cfg = TrainConfig(model=model, seq=seq, batch=batch, steps=steps, precision=precision)
    job = Job(cfg, torch.device("cpu"))
    ms = [job.train_step(i + 1)["step_ms"] for i in range(steps)]
    job.close()
    Path(path).write_text(json.dumps({"step_s": statistics.median(ms[3:]) / 1e3}))
    _finish()


def measure_job(shape: ModelShape, work: Workload, cluster: Cluster, micro_batch: int,
                timeout: float = 180) -> float:
    """The seconds a step of the job costs beyond its modules' compute and the optimizer (the
    batch, zero_grad, the norm pass, the scheduler, Python between layers): a 1-rank Job's
    measured step minus predict_time of the same 1-rank plan with `cluster`. What the ranks
    of one machine cost each other (measured here: two 1-rank gpt-tiny jobs at once step in
    16 ms against 7.0 ms alone, on the 2 cores) is not in it: refit() from a run has it."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "job.json")
        argv = ["-c", "from pyfast.plan.calibrate_job import job_probe; job_probe("
                f"{path!r}, {gpt_model_flag(shape)!r}, {work.seq}, {micro_batch}, "
                f"{work.precision!r})"]
        _child(argv, timeout)
        step = json.loads(Path(path).read_text())["step_s"]
    one = Plan(micro_batch=micro_batch)
    pred = timing.predict_time(shape, one, Workload(work.seq, micro_batch, work.precision),
                               cluster)
    return max(0.0, step - pred["step_s"])
