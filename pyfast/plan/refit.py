"""Refit the time model's scales from a measured run (`pyfast plan --calibrate RUNDIR`)."""
from __future__ import annotations

import statistics
from pathlib import Path

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload
from . import timing


def run_plan(rundir) -> tuple[ModelShape, Plan, Workload, dict]:
    """(shape, plan, workload, config) of the run in `rundir`, from its checkpoint's record."""
    from pyfast.train import checkpoint as ck
    found = ck.latest(rundir)
    if found is None:
        raise ValueError(f"{rundir}: no complete checkpoint (the run's flags are recorded in "
                         "its checkpoints' meta.json; run `pyfast train` to the end)")
    meta = ck.read_meta(found[1])
    c = meta["config"]
    shape = shape_of(c["model"], meta["vocab_size"], c["seq"], c.get("tie_embeddings", False))
    m = c["micro_batches"] or (1 if c["pp"] == 1 else 2 * c["pp"])
    pieces = m * c["grad_accum"]
    plan = Plan(dp=c["dp"], cp=c["cp"], tp=c["tp"], pp=c["pp"], zero=c["zero"],
                compress=c["compress"], micro_batch=c["batch"] // (c["dp"] * pieces),
                micro_batches=pieces, schedule=c["schedule"],
                activation_checkpointing=c["activation_checkpointing"],
                cp_method=c["cp_method"], param_compress=c["param_compress"])
    return shape, plan, Workload(c["seq"], c["batch"], c["precision"]), c


def shape_of(model: str, vocab: int, seq: int, tied: bool = False) -> ModelShape:
    """The ModelShape of a `pyfast train --model` (built on the meta device: no memory)."""
    import torch
    from pyfast import models
    with torch.device("meta"):
        m = models.build(model, vocab, seq, tie_embeddings=tied)
    g = m.cfg
    return ModelShape(g.n_layer, g.d_model, g.n_head, g.n_head, g.mlp_ratio * g.d_model, vocab,
                      tied=tied, name=model)


def refit(cluster: Cluster, rundir, skip: int = 2, comm: bool = True) -> Cluster:
    """compute_scale (and comm_scale unless comm=False) = measured / predicted for the run in
    `rundir` (its metrics.jsonl and the flags its checkpoint recorded): refit_records."""
    from pyfast.train.metrics import read
    recs = read(Path(rundir) / "metrics.jsonl")
    shape, plan, work, _ = run_plan(rundir)
    return refit_records(cluster, shape, plan, work, recs, skip, comm)


def refit_records(cluster: Cluster, shape: ModelShape, plan: Plan, work: Workload,
                  recs: list[dict], skip: int = 2, comm: bool = True) -> Cluster:
    """Medians over the steps after the first `skip` of compute_ms (step - the waits on
    communication, job.train_step's split) and exposed_comm_ms, against the plan's prediction
    with `cluster` (its earlier scales dropped): compute_scale = measured / predicted compute
    (everything but the exposed communication), comm_scale = measured / predicted exposed
    communication (kept at 1 when the prediction has none or comm=False)."""
    recs = recs[skip:]
    if not recs:
        raise ValueError(f"no steps after the first {skip} to refit from")
    base = {k: v for k, v in cluster.calibration.items() if k not in ("compute_scale",
                                                                       "comm_scale")}
    pred = timing.predict_time(shape, plan, work, cluster.replace(calibration=base))
    comp = statistics.median(r["compute_ms"] for r in recs) / 1e3
    waited = statistics.median(r["exposed_comm_ms"] for r in recs) / 1e3
    cal = dict(base, compute_scale=comp / (pred["step_s"] - pred["exposed_comm_s"]))
    if comm and pred["exposed_comm_s"] > 0 and waited > 0:
        cal["comm_scale"] = waited / pred["exposed_comm_s"]
    return cluster.replace(calibration=cal)
