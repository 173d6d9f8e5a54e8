"""`pyfast train --elastic`: restarts at another world size (torchrun --nnodes MIN:MAX restarts
every worker with a new WORLD_SIZE on a membership change; pyfast's launcher --nproc N) re-plan
the data-parallel size and keep the global batch. The flags, their check, the plan and the lines
the job logs; kept here so config.py, run.py and launch.py grow by a few lines each. No torch
import at module level (config.py parses flags without torch).

The plan (plan()): tp, pp and cp are the flags' (a restart never re-cuts the model); dp = world
/ (tp x pp x cp). The micro-batch (sequences one forward pass reads) is the flags':
--batch / (--dp x --grad-accum x micro-batches), and --grad-accum becomes --batch / (dp x
micro-batches x micro-batch), so the global batch, --batch, stays what the run asked for: size
the flags for the largest world (torchrun's MAX) and smaller worlds accumulate more. Every
global step reads the same sequences at any dp (pyfast.data.Batches: global batch k is rows
[k B, (k+1) B) of the epoch's permutation, dp rank r takes its contiguous B / dp of them) and
the loss is their mean, so only the reduction order differs from an uninterrupted run.

What a checkpoint written at another dp cannot carry over: the per-dp-rank state (each rank's
error-feedback memory or PowerSGD state of --compress, and its RNG state). Job.load leaves it
out when the mesh differs; here that is said (describe_reset): the memory starts from zero, as
in a fresh run's first step.
"""
from __future__ import annotations

import argparse
import dataclasses


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("elastic restarts (torchrun --nnodes MIN:MAX, or --nproc N)")
    g.add_argument("--elastic", action="store_true", default=d.elastic,
                   help="re-plan dp for the world this start finds: dp = world / (tp x pp x cp), "
                        "tp/pp/cp kept, and --grad-accum set so that the global batch (--batch) "
                        "stays; the micro-batch is the flags' (--batch / (--dp x --grad-accum x "
                        "micro-batches)), so give the mesh flags of the largest world. Resumes "
                        "from the latest complete checkpoint in --out when there is one (written "
                        "at any world size), else starts fresh. Per-rank error-feedback memory "
                        "restarts from zero when dp changed. The dry run plans for --nproc and "
                        "reads no checkpoint (a printed note)")


def problem(cfg) -> str | None:
    """What is wrong with --elastic against the other flags (the world: plan); None if nothing."""
    if not cfg.elastic:
        return None
    if cfg.diloco or cfg.replicas > 1:
        return (f"--elastic with --diloco / --replicas {cfg.replicas}: elastic restarts re-plan "
                "the data-parallel size of one mesh; replicas that come and go are torchft's "
                "(--ft, docs/fault_tolerance.md)")
    return None


def plan(cfg, world: int):
    """cfg for a world of `world` ranks, or what is wrong (a str, told with the numbers: config.
    plan_world raises it as a ConfigError; this module imports nothing of config). Unchanged
    without --elastic; with it dp = world / (tp x pp x cp) and grad_accum = batch /
    (dp x micro-batches x micro-batch), the micro-batch the flags' --batch / (--dp x --grad-accum
    x micro-batches)."""
    if not cfg.elastic:
        return cfg
    why = problem(cfg)
    if why:
        return why
    bad = [f"--{k} {getattr(cfg, k)}" for k in ("dp", "tp", "pp", "cp", "grad_accum")
           if getattr(cfg, k) < 1]
    if bad:
        return f"{', '.join(bad)}: must be >= 1"
    fixed, per = cfg.tp * cfg.pp * cfg.cp, cfg.dp * cfg.grad_accum * cfg.m
    if world < 1 or world % fixed:
        return (f"--elastic: a world of {world} ranks is not divisible by tp {cfg.tp} x pp "
                f"{cfg.pp} x cp {cfg.cp} = {fixed}, which a restart keeps (dp would be {world} / "
                f"{fixed} = {world / fixed:g}); restart with a multiple of {fixed} ranks")
    if cfg.batch % per:
        return (f"--batch {cfg.batch} is not divisible by dp {cfg.dp} x grad-accum "
                f"{cfg.grad_accum} x micro-batches {cfg.m} = {per} (the flags' micro-batch, "
                "which --elastic keeps)")
    dp, mb = world // fixed, cfg.batch // per
    per = dp * cfg.m * mb
    if cfg.batch % per:
        return (f"--elastic: the global batch --batch {cfg.batch} is not divisible by dp {dp} x "
                f"micro-batches {cfg.m} x micro-batch {mb} = {per} at a world of {world} ranks "
                f"(micro-batch: --batch {cfg.batch} / (--dp {cfg.dp} x --grad-accum "
                f"{cfg.grad_accum} x micro-batches {cfg.m})); give the mesh flags of the largest "
                "world, or a --batch that divides")
    return dataclasses.replace(cfg, dp=dp, grad_accum=cfg.batch // per)


def world_of(mesh: dict) -> int:
    """The ranks of a checkpoint's recorded mesh (meta.json "mesh")."""
    return (mesh.get("replicas", 1) * mesh["dp"] * mesh.get("cp", 1) * mesh["tp"]
            * mesh["pp"])


def describe(cfg, meta: dict | None, step: int = 0, flags=None) -> str | None:
    """What the start changed, for the log line and the run's summary:
    'elastic restart at step S: world 4 -> 2, dp 4 -> 2, grad accumulation 1 -> 2 (global batch
    32 kept)'; meta: the resumed checkpoint's record (None: a fresh start, compared with
    `flags`, the TrainConfig as asked; None when nothing differs)."""
    world = cfg.ranks
    if meta is None:
        if flags is None or (flags.dp, flags.grad_accum) == (cfg.dp, cfg.grad_accum):
            return None
        return (f"elastic start: world {world} (the flags' mesh is {flags.ranks}), dp "
                f"{flags.dp} -> {cfg.dp}, grad accumulation {flags.grad_accum} -> "
                f"{cfg.grad_accum} (global batch {cfg.batch})")
    saved = meta.get("config", {})
    w0, dp0 = world_of(meta["mesh"]), meta["mesh"]["dp"]
    a0 = saved.get("grad_accum", cfg.grad_accum)
    if (w0, dp0, a0) == (world, cfg.dp, cfg.grad_accum):
        return f"elastic restart at step {step}: world {world} (unchanged)"
    return (f"elastic restart at step {step}: world {w0} -> {world}, dp {dp0} -> {cfg.dp}, grad "
            f"accumulation {a0} -> {cfg.grad_accum} (global batch {cfg.batch} kept)")


def describe_reset(cfg, meta: dict, same: bool) -> str | None:
    """The warning when a restart at another mesh drops the per-dp-rank compression state (Job.
    load's same=False: each rank's error-feedback memory, PowerSGD's matrices, auto's choice);
    None when there was none to drop."""
    if same or cfg.compress in ("none", ""):
        return None
    import pyfast.compress as C
    c = None if cfg.compress == "auto" else C.get(cfg.compress)
    if c is not None and c.algorithm != "powersgd" and not (cfg.error_feedback == "on"
                                                            and c.lossy):
        return None  # a lossless cast (fp16, bf16) without feedback keeps no state
    dp0 = meta["mesh"]["dp"] * meta["mesh"].get("cp", 1)
    return (f"--compress {cfg.compress}: the compression state (error-feedback memory and codec "
            f"state, one per dp rank: {dp0} in the checkpoint, {cfg.dp * cfg.cp} now) is not "
            "carried across the mesh change: it starts from zero, as on a fresh run's first step")
