"""The job on one rank, under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set): resume, the step
loop, validation, checkpoints, metrics; a failure stops every rank with the reason."""
from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from . import batch_split, checkpoint as ck, elastic, offload, pp_balance, profile
from .ckpt_async import CheckpointError, Checkpointer, summary_rows
from .config import (ConfigError, TrainConfig, check, check_data, plan_world,
                     resume_changes)
from .job import Job, NonFiniteError
from .metrics import MetricsLog, Progress, plot, read, summary
from .sample import Sampler
from .telemetry import GPU, peak_rss_mb
from .tensorboard import TensorBoardLog, describe as describe_tensorboard, resolve as tb_on


def warn(msg: str) -> None:
    print(f"pyfast train: warning: {msg}", file=sys.stderr, flush=True)


def check_resume(cfg: TrainConfig, restarted: bool, say=warn, data: dict | None = None
                 ) -> tuple[int, object] | None:
    """The checkpoint to resume from, or None for a fresh start; ConfigError when --resume
    finds none, when its run differs from this one in anything but what may change
    (config.resume_changes: every difference named, with both values), or when a fresh run
    would mix with old ones. `say` (None: silent) gets each skipped checkpoint directory and
    each allowed change; `data`: the data's fingerprint if known (else computed here).
    --elastic resumes like --resume when a checkpoint exists and starts fresh when none does;
    the dp / grad-accum change it made itself is told by elastic.describe, not here."""
    quiet = say or (lambda msg: None)
    found = ck.latest(cfg.out, warn=quiet)
    if cfg.resume or restarted or cfg.elastic:
        if found is None:
            if restarted or cfg.elastic:  # died before the first checkpoint / a first start
                return None
            raise ConfigError(f"--resume: no complete checkpoint under {ck.root(cfg.out)}")
        meta = ck.read_meta(found[1])
        if "config" not in meta:  # written before the run was recorded: the model only
            if meta["model_key"] != cfg.model_key():
                raise ConfigError(f"--resume: {found[1]} holds a different model: "
                                  f"{meta['model_key']}, this run is {cfg.model_key()}")
            quiet(f"{found[1]} records only its model: the other flags cannot be compared")
            return found
        refused, changed = resume_changes(cfg, meta, data or check_data(cfg))
        if cfg.steps < found[0]:  # equal: a finished run (restarted after its last save)
            refused.append(f"--steps {cfg.steps}: the checkpoint is at step {found[0]} already")
        if refused:
            raise ConfigError(f"--resume: {found[1]} was written by another run; "
                              + "; ".join(refused) + ". Only the mesh, the eval/checkpoint "
                              "cadence and (with --allow-change steps) --steps may change")
        if cfg.elastic:  # elastic.plan's own change: its line says it
            changed = [c for c in changed if not c.startswith(("--dp:", "--grad-accum:"))]
        for c in changed:
            quiet(f"--resume from {found[1]} with a changed flag: {c}")
        return found
    if found is not None:
        raise ConfigError(f"{cfg.out} already has checkpoints (latest step {found[0]}): pass "
                          f"--resume to continue, or choose another --out")
    return None


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def run(cfg: TrainConfig, device: torch.device, restarted: bool = False) -> None:
    """This rank's part of the job in a process group that is already up (main's, or ranks a
    test started once for many jobs): the checks, the resume, the step loop, the job closed.
    ConfigError / NonFiniteError are decided alike on every rank; anything else raised is this
    rank's alone (the others may sit in a collective)."""
    rank = dist.get_rank()
    asked, cfg = cfg, plan_world(cfg, dist.get_world_size())  # --elastic: dp for this world
    # same flags, same answer on every rank; the model's limits are checked on the model
    # itself when the job builds it, before its first collective after the Mesh
    data = check(cfg, dist.get_world_size(), model=False)
    found = check_resume(cfg, restarted, say=warn if rank == 0 else None, data=data)
    job = Job(cfg, device, data)
    try:
        start, note, same, meta = 0, "fresh start", True, None
        if found is not None:
            start, same = job.load(found[1])
            meta = ck.read_meta(found[1])
            note = f"resumed from {found[1]}" + ("" if same else " (another mesh, compressor, "
                                                 "precision or --zero stage: per-rank RNG and "
                                                 "compression state not restored)")
        restart = elastic.describe(cfg, meta, start, asked) if cfg.elastic else None
        if rank == 0:
            lora = (f", LoRA rank {cfg.lora}: {job.n_trainable / 1e6:.3f}M trainable"
                    if cfg.lora else "")
            print(f"pyfast train: {cfg.model} ({job.n_params / 1e6:.2f}M parameters{lora}), "
                  f"{job.mesh}, {cfg.precision}, compress {cfg.compress}; "
                  f"{job.corpus.source}; {note}", flush=True)
            print(describe_tensorboard(cfg.tensorboard, cfg.out), flush=True)
            for line in (job.frozen_note, offload.describe(job) if job.zero else None,
                         restart, job.ft.describe() if job.ft is not None else None,
                         pp_balance.describe(job),
                         batch_split.describe(job.split, cfg.batch), job.split_note):
                if line:
                    print(f"pyfast train: {line}", flush=True)
            if cfg.elastic and meta is not None and elastic.describe_reset(cfg, meta, same):
                warn(elastic.describe_reset(cfg, meta, same))
        _loop(cfg, job, start, device, restart)
    except (ConfigError, NonFiniteError, CheckpointError):
        job.close()
        raise
    job.close()  # not after another error: closing may wait on a peer that is gone


def bench_throttle(env: str | None = None, rank: int | None = None) -> float | None:
    """Benchmarks only (`pyfast bench plan_mixed`), not a feature: PYFAST_THROTTLE="R:SHARE[,
    R:SHARE...]" caps global rank R's process at SHARE CPUs (pyfast.hetero.throttle) for the
    rest of its life: an emulated slower GPU beside full-speed peers. Returns the share set
    on this rank (None: none); ValueError for a malformed value, HeteroUnavailable where
    caps cannot be set (never a silent full-speed run)."""
    env = os.environ.get("PYFAST_THROTTLE", "") if env is None else env
    if not env:
        return None
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    share = None
    for item in env.split(","):
        r, sep, v = item.partition(":")
        try:
            if not sep:
                raise ValueError
            r, v = int(r), float(v)
        except ValueError:
            raise ValueError(f"PYFAST_THROTTLE={env!r}: RANK:SHARE[,RANK:SHARE...], e.g. "
                             "1:0.5 (rank 1 at half a CPU)") from None
        if r == rank:
            share = v
    if share is not None:
        from pyfast import hetero
        # hold(), not a bare throttle(share).__enter__(): that object is collected at once and
        # its generator's finally lifts the cap (seen: the job ran 1:0.1 as fast as
        # unthrottled, 490 vs 489 ms)
        hetero.hold(share)
    return share


def main(cfg: TrainConfig, leave: bool = True) -> int:
    bench_throttle()
    device = _device()
    # device_id binds NCCL's communicator to this rank's GPU: without it every barrier warned
    # "using the device under current context" (seen on the lent H200)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    try:
        run(cfg, device, restarted)
        code = 0
    except (ConfigError, NonFiniteError, CheckpointError) as e:  # decided alike on every rank
        if dist.get_rank() == 0:
            print(f"pyfast train: error: {e}", file=sys.stderr, flush=True)
        code = {ConfigError: 2, NonFiniteError: 3}.get(type(e), 4)
    except BaseException:  # this rank only: the others may sit in a collective. Leave now;
        # torchrun sees the exit and stops (or restarts) every rank within its monitor period
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    gc.collect()  # the job's modules sit in reference cycles: freed now, while the group lives
    dist.barrier()  # a rank leaving while another still reads the group aborts the other
    dist.destroy_process_group()
    # Then leave without the interpreter's teardown: C++ destructors it runs after the group is
    # gone (gloo work held by objects freed late) aborted a rank at exit, "terminate called
    # without an active exception" (a --pp 2 job in CI; a 2-rank 1f1b loop here 1-3 runs in 8
    # without the collect and barrier). Everything is written and closed by now (job.close()).
    sys.stdout.flush()
    sys.stderr.flush()
    if not leave:  # a forked rank (launch.forked_rank): multiprocessing's os._exit follows
        return code
    os._exit(code)


def _loop(cfg: TrainConfig, job: Job, start: int, device, restart: str | None = None) -> None:
    """restart: what an elastic start changed (elastic.describe), kept in the first step's
    record ("elastic"), whence the summary's row."""
    rank = dist.get_rank()
    log = MetricsLog(cfg.out, start) if rank == 0 else None
    bar = Progress(cfg.steps, start) if rank == 0 else None
    gpu = GPU(device)
    tb = TensorBoardLog(cfg.out, start) if rank == 0 and tb_on(cfg.tensorboard) else None
    sampler = Sampler(cfg) if cfg.sample_every else None
    saver = Checkpointer(cfg.ckpt_async, device)
    cost = {}  # what the last checkpoint cost its step: logged with the next step's record
    prof = profile.Profiler(cfg, start, device, rank, dist.get_world_size()) \
        if cfg.profile else None  # --profile (pyfast.train.profile)
    try:
        # --ft: a step that does not commit is attempted again (ft_step.FTStep.steps)
        for step in job.ft.steps(start) if job.ft is not None else range(start + 1, cfg.steps + 1):
            rec = job.train_step(step) if prof is None else prof.run(job, step)
            step = rec["step"]
            if not rec.get("committed", True):  # --ft: logged, nothing else (no eval, no save)
                if rank == 0:
                    with job.not_sent():
                        log.write({**rec, "time": time.time()})
                continue
            if restart is not None and step == start + 1:
                rec["elastic"] = restart
            # --ckpt-async: commit the checkpoint in flight once every rank wrote it (or
            # CheckpointError on every rank, if a write failed)
            with job.not_sent():  # files, the terminal: not sent bytes (Job.mark)
                rec.update(cost, **saver.poll())
            cost = {}
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                rec["val_loss"] = job.evaluate()
                if cfg.eval_outer:
                    rec["val_loss_outer"] = job.evaluate_outer()
                err = job.compression_error()
                if err is not None:
                    rec["compress_rel_error"] = err
            rss = job.scalar(peak_rss_mb())
            # --replicas R > 1: over this replica's ranks (a step never crosses between them)
            dist.all_reduce(rss, op=dist.ReduceOp.MAX, group=job.step_group)
            rec.update(max_rss_mb=float(rss), **gpu.sample())
            with job.not_sent():
                if sampler is not None and (step % cfg.sample_every == 0 or step == cfg.steps):
                    rec["sample"] = sampler(job, step, bar.console if rank == 0 else None)
                if rank == 0:
                    rec["time"] = time.time()  # the step's end, unix seconds (recovery timings)
                    log.write(rec)
                    bar.update(rec)
                    if tb is not None:
                        tb.write(rec)
                if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
                    cost = saver.save(job, cfg.out, step, keep_last=cfg.keep_last)
        saver.finish()  # the last checkpoint is complete before the job goes on to exit
    except (ConfigError, NonFiniteError):  # every rank alike: the save in flight is finished
        try:
            saver.finish()
        except CheckpointError as e:
            warn(f"{e}")
        raise
    finally:
        saver.close()
        if prof is not None:
            prof.close()
        if rank == 0:
            bar.close()
            log.close()
            if tb is not None:
                tb.close()
    if rank == 0:
        records = read(log.path)
        drawn = "plot: none (no step logged)" if cfg.plot else "plot: none (--no-plot)"
        if records:
            if cfg.plot:
                drawn = plot(records, os.path.join(cfg.out, "curves.png"))
            from rich.console import Console
            m = job.mesh
            rep = f"{m.replicas} replicas of " if m.replicas > 1 else ""
            t = summary(records, f"{cfg.model} on {rep}{m.dp}x{m.cp}x{m.tp}x{m.pp} "
                                 "(dp x cp x tp x pp)")
            for k, v in summary_rows(saver.stats):  # what the checkpoints cost the steps
                t.add_row(k, v)
            for k, v in pp_balance.summary_rows(job, records):  # stages and their bubble
                t.add_row(k, v)
            Console().print(t)
        print(f"metrics: {log.path}\n{drawn}\ncheckpoints: {ck.root(cfg.out)}", flush=True)
