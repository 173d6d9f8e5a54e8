"""Calibration probes that need their ranks running at once (pyfast.plan.calibrate): a tp
plan's block on tp gloo ranks (its all-reduces and the waits between them included), ZeRO's
per-step costs beyond plain local training (its hooks, reduce-scatters, sharded optimizer,
all-gathers and the Python around them), and the pipeline runtime's own cost a micro-batch,
all on loopback.

Why measured rather than summed from the link fit: on this 2-core machine gpt-tiny's tp2 step
took 21.7-22.5 ms where the modules' compute plus 8 fitted all-reduces made 11.7 (each blocking
all-reduce after compute cost ~1.2 ms, not the 0.25 ms of back-to-back calls, and the wake-up
probe saw 0 to 1.6 ms from one run to the next); ZeRO-1 stepped in 18.9-19.6 ms against 15.2-15.8
for plain dp2 and 9.0-10.8 predicted (bench/results/plan_time*.txt, 2026-11-25)."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .spec import ModelShape, Plan, Workload, gpt_model_flag
from . import timing
from .timing_zero import zero_key
from .timing_reduce import PER_PARAM
from .calibrate_link import PROBE_S, _child, _finish, rounds

REPEATS = 9  # medians of 9 after 2 warm steps: one rank's step varied 11-22 ms (q10-q90) here
# tp's block timed CHAIN times back to back, as the job's layers run (no barrier between them):
# one block after a barrier priced gpt-tiny's tp2 block at 7.9 + 10.6 ms on loopback, the two
# blocks then 37 ms of a run measured at 22.4 ms a step (quiet run, 2026-11-28)
CHAIN = 4


def _amp(precision: str, fn):
    import torch
    from pyfast.train.job import AMP
    return torch.autocast("cpu", dtype=AMP[precision])(fn) if precision in AMP else fn


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist
    w = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    return w.tolist()


def timed_chain(fwd, make_x, chain: int = CHAIN, repeats: int = REPEATS) -> list[float]:
    """[forward_s, backward_s] of one block on ranks running at once: `fwd` applied `chain`
    times in a row, then backward through them all, after a barrier (the medians of as many
    chains as calibrate_link.PROBE_S allows, `repeats` to MAX_REPEATS, after 2 warm ones; a
    block's share). The max over ranks of the whole (forward + backward), split as the ranks'
    mean split: a rank that leaves the barrier late makes its peer's forward wait and its own
    backward not, so the max of each half counted that skew twice. Why a time budget: 9
    chains priced gpt-tiny's tp2 block 6.9-10.7 ms over twelve plan_time runs (sessions
    51-52), its run steady at 18-22 ms, and the row off by -25% to +26%."""
    import torch
    import torch.distributed as dist
    fs, bs = [], []

    def one():
        x = make_x()
        dist.barrier()
        t0 = time.perf_counter()
        y = x
        for _ in range(chain):
            y = fwd(y)
        t1 = time.perf_counter()
        y.backward(torch.randn_like(y))
        return t1 - t0, time.perf_counter() - t1

    t_warm = time.perf_counter()
    for _ in range(2):
        one()
    for _ in range(rounds((time.perf_counter() - t_warm) / 2, repeats)):
        f, b = one()
        fs.append(f / chain)
        bs.append(b / chain)
    fb = _max_over_ranks([statistics.median(f + b for f, b in zip(fs, bs))])[0]
    share = torch.tensor([statistics.median(fs) / max(statistics.median(fs) +
                                                        statistics.median(bs), 1e-30)],
                         dtype=torch.float64)
    dist.all_reduce(share)
    share = share.item() / dist.get_world_size()
    return [fb * share, fb * (1 - share)]


def _init():
    import datetime
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)


def tp_probe(path: str, model: str, vocab: int, seq: int, micro_batch: int,
             precision: str) -> None:
    """A rank of the tp block probe (env://, gloo, world = tp): pyfast's Block under
    parallelize(model.tp_plan()) as the job splits it, CHAIN times in a row forward, then
    backward, timed (a block's share; medians, max over ranks); rank 0 writes [forward_s,
    backward_s] to `path`."""
    import torch
    import torch.distributed as dist
    from pyfast import models
    from pyfast.parallel import parallelize
    _init()
    m = models.build(model, vocab, seq)
    parallelize(m, m.tp_plan(), group=dist.group.WORLD)
    block = m[1]
    fwd = _amp(precision, block.forward)
    w = timed_chain(fwd, lambda: torch.randn(micro_batch, seq, m.cfg.d_model,
                                             requires_grad=True))
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(w))
    _finish()


def zero_probe(path: str, model: str, vocab: int, seq: int, micro_batch: int,
               precision: str, configs: list) -> None:
    """A rank of the ZeRO probe (env://, gloo, 2 ranks): the model wrapped as the job wraps it
    for each (stage, compressor) of `configs` (zero() with AdamW and the job's two parameter
    groups; stage 0: DataParallel) and the same model unwrapped, all stepped in turn, round
    after round, on both ranks at once (the plain one with the job's fused norm pass and
    AdamW, no communication; the ZeRO ones with clip_grad_norm_ and their step, DataParallel's
    as the plain one). Rank 0 writes, per config, [forward+backward extra, step extra]: the
    medians over the rounds of each round's wrapped minus plain (paired: the two ran under the
    same load), max over ranks; under DataParallel the first is its hooks and the wait for
    the last bucket, and a third value follows: the wait alone (DataParallel.last_wait_s, the
    job's exposed_comm_ms). The job counts the hooks' CPU as compute, and so does timing (the
    rest of the extra): quiet run 2026-11-28, gpt-tiny dp2 on loopback, the probe's extra
    10.8 ms, the run's measured wait 5.8, predicted step +59% with the whole extra as wait.

    Why one probe for all configs, and as many rounds as calibrate_link.PROBE_S allows
    (REPEATS to MAX_REPEATS; gpt-small stays at REPEATS): run one config a probe, 9 rounds
    each, gpt-tiny's DataParallel wait on loopback came out 1.3-5.6 ms for int8 and 3.1-6.5
    for no compressor over four runs (session 51), int8 the shorter in three, and the planner
    ranked dp2 int8 first on loopback where the two measured within 1%; three probes of both in
    one run each: 3.3-3.9 and 2.5-3.3 ms."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from pyfast import models
    from pyfast.parallel.zero import zero
    _init()

    def build():
        torch.manual_seed(0)
        m = models.build(model, vocab, seq)
        groups = [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        return m, groups

    def plain():
        pm, pg = build()
        popt = torch.optim.AdamW(pg, lr=1e-4, betas=(0.9, 0.95))

        def step():
            ps = [p for p in pm.parameters() if p.grad is not None]
            torch.stack(torch._foreach_norm([p.grad for p in ps])).double().square().sum()
            popt.step()
        return pm, popt, step

    def wrapped(stage, compress):
        zm, zg = build()
        if stage:
            net, zopt = zero(zm, torch.optim.AdamW, stage=stage, compressor=compress,
                             params=zg, lr=1e-4, betas=(0.9, 0.95))
        else:
            from pyfast.parallel import DataParallel
            net = DataParallel(zm, compressor=compress, check_finite=False)
            zopt = torch.optim.AdamW(zg, lr=1e-4, betas=(0.9, 0.95))

        def step():
            if not stage:
                ps = [p for p in zm.parameters() if p.grad is not None]
                torch.stack(torch._foreach_norm([p.grad for p in ps])).double().square().sum()
            else:
                zopt.clip_grad_norm_(float("inf"))
            zopt.step()
        return net, zopt, step

    runs = [plain()] + [wrapped(st, c) for st, c in configs]

    def one(mod, opt, step):
        ids = torch.randint(0, vocab, (micro_batch, seq))
        tgt = torch.randint(0, vocab, (micro_batch * seq,))
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        logits = _amp(precision, mod.forward)(ids)
        F.cross_entropy(logits.flatten(0, -2).float(), tgt).backward()
        t1 = time.perf_counter()
        step()
        return t1 - t0, time.perf_counter() - t1

    t0 = time.perf_counter()
    for _ in range(2):  # warm: first-step allocations, the engines' buffers
        for r in runs:
            one(*r)
    diffs = [([], [], []) for _ in configs]
    # twice the other probes' budget: a DataParallel wait varies widely from step to step
    # (gpt-tiny's under powersgd:4 19-53 ms in a run and in this probe alike), and 3 s (19
    # rounds of plan_time's four gpt-tiny configs) gave its median 33-44 ms over ten probes
    for _ in range(rounds((time.perf_counter() - t0) / 2, REPEATS, 2 * PROBE_S)):
        base = one(*runs[0])
        for (stage, _), r, d in zip(configs, runs[1:], diffs):
            fb, st = one(*r)
            d[0].append(fb - base[0])
            d[1].append(st - base[1])
            if not stage:
                d[2].append(r[0].last_wait_s)
    out = {}
    for (stage, compress), d in zip(configs, diffs):
        out[f"{stage}:{compress}"] = _max_over_ranks(
            [statistics.median(d[0]), statistics.median(d[1])]
            + ([statistics.median(d[2])] if d[2] else []))
    for net, _, _ in runs[1:]:
        close = getattr(net, "close", None)
        if close is not None:
            close()
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(out))
    _finish()


def pp_probe(path: str, schedule: str, micro_batches: int, virtual: int) -> None:
    """A rank of the pipeline probe (env://, gloo, world = pp): pyfast's Pipeline as the job
    builds it (its default transport) over 2 x world x virtual Linear(64, 64), micro-batches
    of 2 rows: the runtime's own seconds a micro-batch and virtual stage beyond the stages'
    compute and the waits for messages (Pipeline.last_stats: wall - compute - idle; sends,
    headers, the outcome's agreement, the Python between actions), the median of as many
    steps as calibrate_link.PROBE_S allows (REPEATS to MAX_REPEATS) after 2 warm ones, max
    over ranks; rank 0 writes [seconds]. (9 steps gave gpt-tiny's pp2 0.40-0.96 ms a
    micro-batch over eight plan_time runs.)"""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from pyfast.parallel import Pipeline
    _init()
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = nn.Sequential(*[nn.Linear(64, 64) for _ in range(2 * world * virtual)])
    pipe = Pipeline.from_sequential(seq, micro_batches, schedule, F.mse_loss,
                                    virtual_stages=virtual)
    x = torch.randn(2 * micro_batches, 64)
    t = torch.randn_like(x)

    def one():
        pipe.zero_grad(set_to_none=True)
        dist.barrier()
        pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
        s = pipe.last_stats
        return (s["wall"] - s["compute"] - s["idle"]) / (micro_batches * virtual)

    t0 = time.perf_counter()
    one(), one()
    per = [one() for _ in range(rounds((time.perf_counter() - t0) / 2, REPEATS))]
    w = _max_over_ranks([statistics.median(per)])
    if rank == 0:
        Path(path).write_text(json.dumps(w))
    _finish()


def measure_pp(plans, timeout: float = 120) -> dict:
    """{timing.pp_key(plan): seconds} of each pipeline plan's schedule on pp gloo ranks on
    loopback (pp_probe). Measured, not assumed: gpt-tiny's pp2 steps took 17-21 ms where the
    stages' compute, the transfers and the bubble made 13-16 (plan_time, session 51: 22-32%
    fast at 1 and 10 Gbit/s); 0.7 ms a micro-batch on this 2-core VM, and with it those rows
    came within 7-17% (replayed on three runs' calibrations)."""
    out = {}
    for plan in plans:
        key = timing.pp_key(plan)
        if plan.pp == 1 or key in out:
            continue
        out[key] = _probe("pp_probe", f"{plan.schedule!r}, {plan.micro_batches}, "
                          f"{plan.virtual_stages}", plan.pp, timeout)[0]
    return out


def _probe(fn: str, args: str, world: int, timeout: float):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "probe.json")
        argv = ["-c", f"from pyfast.plan.calibrate_dist import {fn}; {fn}({path!r}, {args})"]
        _child(argv, timeout, world=world)
        return json.loads(Path(path).read_text())


def measure_tp_blocks(shape: ModelShape, work: Workload, plans, timeout: float = 180) -> dict:
    """{compute_key + ":dist": [forward_s, backward_s]} of each tp plan's block (cp 1), timed
    on tp gloo ranks on loopback: the block's compute with its all-reduces and their waits."""
    out = {}
    for plan in plans:
        key = timing.compute_key("block", plan, work) + ":dist"
        if plan.tp == 1 or plan.cp > 1 or key in out:
            continue
        one = gpt_model_flag(replace(shape, layers=1))
        out[key] = _probe("tp_probe", f"{one!r}, {shape.vocab}, {work.seq}, {plan.micro_batch}, "
                          f"{work.precision!r}", plan.tp, timeout)
    return out


def measure_zero(shape: ModelShape, work: Workload, plans, timeout: float = 300) -> dict:
    """{zero_key: [forward+backward extra_s, step extra_s]} of each ZeRO plan (its stage and
    micro-batch, 2 ranks on loopback), and of each plain data-parallel plan (key "zero0:...",
    any compressor): zero_probe, one for every plan of a micro-batch. Top-k's and PowerSGD's
    per-parameter calls too: DataParallel runs them on its thread beside the backward, and
    gpt-tiny's powersgd:4 step waited 33-37 ms for them in this probe (31-35 in its runs at
    1 Gbit/s and 100 Mbit/s) where reduce_seconds' back-to-back calls summed to 20-28 ms
    (plan_time's PowerSGD rows -9% to -33% in six runs, session 52). Each of these two has a
    probe of its own, as the job has one DataParallel a process: beside the other configs'
    DataParallels in one probe, PowerSGD's wait came out 32-39 ms (median 36.8 over nine
    probes; plan_time's PowerSGD rows at 1 Gbit/s +6% to +23% in all eight runs s53g-s56a),
    alone 30-34 (median 31.4 over five), and 29-35 in its runs on loopback, 1 Gbit/s and
    100 Mbit/s; top-k's alike either way (49-53 shared, 51-55 alone)."""
    by_mb: dict = {}
    for plan in plans:
        key = zero_key(plan, work)
        if plan.dp != 2 or plan.tp > 1 or plan.pp > 1 or plan.cp > 1 or plan.lora:
            continue
        alone = plan.compress if plan.compress.partition(":")[0] in PER_PARAM else None
        configs = by_mb.setdefault((plan.micro_batch, alone), {})
        configs.setdefault((plan.zero, plan.compress), key)
    out = {}
    for (mb, _), configs in by_mb.items():
        got = _probe("zero_probe", f"{gpt_model_flag(shape)!r}, {shape.vocab}, {work.seq}, "
                     f"{mb}, {work.precision!r}, {list(configs)!r}", 2, timeout)
        for (stage, compress), key in configs.items():
            out[key] = got[f"{stage}:{compress}"]
    return out
