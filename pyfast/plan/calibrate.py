"""Plans for this machine, measured rather than assumed: `pyfast plan --measure` (measure) and
`pyfast plan --calibrate RUNDIR` (refit).

Keys of Cluster.calibration (all optional; pyfast.plan.timing reads them):
    "compute": {timing.compute_key(kind, plan, work): [forward_s, backward_s]} one micro-batch
        through one module (kind embed | block | head, the head with its loss; a block key
        ending ":cp": a cp plan's block timed on cp ranks, its loopback traffic included) at
        the plan's local shape (tp's shards, seq/cp tokens, micro_batch sequences, the
        precision's autocast; a checkpointed block's backward includes its recompute), 1
        thread per rank as `pyfast train --nproc N` runs (torchrun: OMP_NUM_THREADS=1)
    "flops_s": the blocks' measured FLOP/s (median), for shapes not measured
    "optim_s_per_param": AdamW step + the job's gradient-norm pass, seconds per parameter
        (timed on the whole model, so the CPU loop's per-tensor cost is spread as in the job)
    "copy_s_per_byte": a 16 MB tensor copy (DataParallel's reduced buckets back into .grad)
    "link_cpu": the loopback link's model: the CPU time of a collective's copies
    "step_overhead_s": a step of the job beyond modules + optimizer (measure_job)
    "cpu_contention": 1.0 on a CPU "cluster" (this machine): the communication thread's CPU
        work (codec + link_cpu) is not hidden behind compute on cores the ranks already fill
    "codec": {spec: [enc_a, enc_b, dec_a, dec_b]}: encode/decode seconds = a + b x elements
        (pyfast.comm.cost.codec_seconds at two sizes)
    "link_intra", "link_inter": {"fits": {primitive: [alpha, beta, free]}, "small_s": s,
        "wake_s": [[work_s, extra_s], ...], "tbf": [rate_bytes_s, burst_bytes],
        "reduce": {spec: [a, b, vector_s]} (reduce_seconds: top-k's / PowerSGD's call a
        parameter)}, a
        pyfast.comm.cost.LinkModel fitted by measure_link on 2 gloo ranks ("link": its name),
        wake_seconds' table, and on a namespace-shaped link its token bucket (probe_link)
    "compute_scale", "comm_scale": refit's measured / predicted (multipliers on the above)
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload, gpt_model_flag
from . import timing

REPEATS = 5   # median of 5 after a warm call: the 2-core machine's noise is ~5-10% per call


def _time(fn, repeats: int = REPEATS) -> float:
    import time
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _local_block(shape: ModelShape, plan: Plan, work: Workload):
    """pyfast's GPT Block at a tp rank's shard sizes (qkv/fc columns and proj rows / tp:
    Attention takes its local head count from qkv's rows, as under parallelize)."""
    import torch
    from pyfast import models
    model = models.build(gpt_model_flag(replace(shape, layers=1)), shape.vocab, work.seq)
    block = model[1]
    t, h, f = plan.tp, shape.hidden, shape.ffn
    if t > 1:
        block.attn.qkv = torch.nn.Linear(h, 3 * h // t)
        block.attn.proj = torch.nn.Linear(h // t, h)
        block.mlp.fc = torch.nn.Linear(h, f // t)
        block.mlp.proj = torch.nn.Linear(f // t, h)
    block.checkpointed = plan.activation_checkpointing
    return model, block


def _fwd_bwd(module, make_in, loss_of=None) -> tuple[float, float]:
    """(forward, backward) seconds, medians."""
    import time
    fs, bs = [], []
    for i in range(REPEATS + 1):
        x = make_in()
        t0 = time.perf_counter()
        y = module(x)
        out = loss_of(y) if loss_of else y
        t1 = time.perf_counter()
        if loss_of:
            out.backward()
        else:
            out.backward(torch_randn_like(out))
        t2 = time.perf_counter()
        if i:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def torch_randn_like(t):
    import torch
    return torch.randn_like(t)


def measure_compute(shape: ModelShape, work: Workload, plans) -> dict:
    """{"compute": ..., "flops_s": ..., "optim_s_per_param": ...} timed here, 1 thread."""
    import torch
    import torch.nn.functional as F
    from pyfast.train.job import AMP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out, rates = {}, []
    for plan in plans:
        s, b = work.seq // plan.cp, plan.micro_batch
        model, block = _local_block(shape, plan, work)

        def run(mod):  # the job autocasts each top-level layer's forward (autocast_layers)
            if work.precision not in AMP:
                return mod
            return torch.autocast("cpu", dtype=AMP[work.precision])(mod.forward)

        key = timing.compute_key("block", plan, work)
        if key not in out:
            fb = _fwd_bwd(run(block), lambda: torch.randn(b, s, shape.hidden, requires_grad=True))
            out[key] = list(fb)
            _, ps = timing._modules(shape, plan, 0)[1]
            fl = timing._module_s("block", ps, shape, plan, work, _unit_cluster())[0]
            rates.append(fl / fb[0])  # _unit_cluster: 1 FLOP/s, so forward "seconds" = FLOPs
        key = timing.compute_key("embed", plan, work)
        if key not in out:
            ids = lambda: torch.randint(0, shape.vocab, (b, s))  # noqa: E731
            emb = model[0]
            out[key] = list(_fwd_bwd(run(emb), ids, lambda y: y.float().square().mean()))
        key = timing.compute_key("head", plan, work)
        if key not in out:
            head = model[-1]
            if plan.tp > 1 and shape.vocab >= timing.VOCAB_PARALLEL_MIN:
                head.lm_head = torch.nn.Linear(shape.hidden, shape.vocab // plan.tp, bias=False)
            v = head.lm_head.out_features
            tgt = torch.randint(0, v, (b * s,))
            out[key] = list(_fwd_bwd(run(head), lambda: torch.randn(b, s, shape.hidden,
                                                                    requires_grad=True),
                                     lambda y: F.cross_entropy(y.flatten(0, -2).float(), tgt)))
    # the optimizer over the whole model's parameters (per-tensor Python costs included: the
    # CPU AdamW loops over tensors), with the job's fused norm pass and zero_grad
    from pyfast import models
    model = models.build(gpt_model_flag(shape), shape.vocab, work.seq)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))

    def step():
        torch.stack(torch._foreach_norm([p.grad for p in params])).double().square().sum()
        opt.step()
    n = sum(p.numel() for p in params)
    big = torch.randn(1 << 22)  # 16 MB: DataParallel's copy of the reduced buckets into .grad
    dst = torch.empty_like(big)
    copy = _time(lambda: dst.copy_(big)) / big.nbytes
    return {"compute": out, "flops_s": statistics.median(rates) if rates else None,
            "optim_s_per_param": _time(step) / n, "copy_s_per_byte": copy}


def _unit_cluster() -> Cluster:
    from .hardware import Gpu
    one = Gpu("unit", 1, 1.0, 1.0, float("inf"), 1.0)
    return Cluster(1, 1, one, 1.0, 1.0, mfu=1.0)


def measure_codecs(specs, shape: ModelShape) -> dict:
    """{spec: [enc_a, enc_b, dec_a, dec_b]} from cost.codec_seconds at two sizes (PowerSGD on
    hidden x k matrices, the others flat)."""
    import torch
    import pyfast.compress as C
    from pyfast.comm import cost
    torch.set_num_threads(1)
    out = {}
    for spec in sorted(set(specs) - {"none", ""}):
        pts = []
        for cols in (shape.hidden, 4 * shape.hidden):
            x = torch.randn(shape.hidden, cols)
            x = x if spec.startswith("powersgd") else x.reshape(-1)
            # with its error-feedback memory, as the job's DataParallel runs it
            enc, dec = cost.codec_seconds(C.wrap(C.get(spec)), x, repeats=REPEATS)
            pts.append((x.numel(), enc, dec))
        (n0, e0, d0), (n1, e1, d1) = pts
        eb, db = max(0.0, (e1 - e0) / (n1 - n0)), max(0.0, (d1 - d0) / (n1 - n0))
        out[spec] = [max(0.0, e0 - eb * n0), eb, max(0.0, d0 - db * n0), db]
    return out


# ---------------------------------------------------------------- the link
PER_TENSOR = ("topk", "powersgd")  # DataParallel reduces these one parameter at a time


def reduce_seconds(specs, hidden: int = 64, chain: int = 8, repeats: int = REPEATS) -> dict:
    """{spec: [a, b, vector_s]}: seconds = a + b x elements of one compressed all-reduce of a
    matrix parameter, vector_s: of a vector (PowerSGD all-reduces those uncompressed)
    (pyfast.comm.collectives.all_reduce with the compressor and its error feedback, as
    DataParallel reduces top-k's and PowerSGD's parameters one by one on its thread), timed
    as a chain of `chain` such calls back to back (median of `repeats` chains, the max over
    ranks) on hidden x hidden and hidden x 4 hidden matrices. Each parameter's call is a few
    dependent collectives with codec work and helper-thread hand-offs between them: gpt-tiny's
    29 parameters under topk:0.01 stepped in 64-106 ms at 1 Gbit/s and 100 Mbit/s against
    36-45 ms from the latency fit + codec, i.e. ~1.5-3 ms a parameter, not the 0.4 ms that
    two back-to-back calls cost."""
    import torch
    import torch.distributed as dist
    import pyfast.compress as C
    from pyfast.comm import collectives
    out = {}
    for spec in sorted({s for s in specs if s.partition(":")[0] in PER_TENSOR}):
        c = C.wrap(C.get(spec))
        pts = []
        for cols in (hidden, 4 * hidden, 0):  # 0: a vector (a bias, a norm's weight)
            xs = [torch.randn(hidden, cols) if cols else torch.randn(hidden + 7)
                  for _ in range(chain)]
            ts = []
            for i in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                for k, x in enumerate(xs):
                    collectives.all_reduce(x, c, name=f"probe{cols}.{k}")
                if i:  # the first chain warms the feedback memories and compressor states
                    ts.append((time.perf_counter() - t0) / chain)
            pts.append((hidden * cols, statistics.median(ts)))
        w = torch.tensor([t for _, t in pts], dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        (n0, _), (n1, _), _ = pts
        t0_, t1_, vec = w.tolist()
        b = max(0.0, (t1_ - t0_) / (n1 - n0))
        out[spec] = [max(0.0, t0_ - b * n0), b, vec]
    return out


def link_probe(path: str, pause: bool, specs=()) -> None:
    """A rank of the link probe (env:// rendezvous, gloo): cost.measure_link, rank 0 writes
    {"fits", "small_s"} as JSON to `path`. Launched by measure() on loopback, and by
    pyfast.benchmarks.plan_time inside a shaped namespace."""
    import datetime
    import torch
    import torch.distributed as dist
    from pyfast.comm import cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    # twice, keeping per primitive the fit that is faster at 256 KB: a probe's first calls
    # (and any taken while another process holds the cores) came out 10x slow, e.g. a 256 B
    # all-reduce at 3-4 ms against 0.3 ms, which then priced every tp and pp call
    fits = [cost.measure_link(pause=pause) for _ in range(2)]
    best = {p: min((lm.fits[p] for lm in fits),
                   key=lambda f: f[0] + f[1] * max(0.0, (1 << 18) - f[2]))
            for p in cost.PRIMITIVES}
    # each primitive's latency: the faster probe's 256 B call (a slow first probe priced a
    # 2-rank 256 B all-reduce at 100 Mbit/s at 1.9 ms against 0.66 ms in another run)
    best = {p: [min(lm.fits[p][0] for lm in fits), *f[1:]] for p, f in best.items()}
    small = min(lm.small_s for lm in fits)
    # a 256 B and a 16 B all-reduce are the same call (one packet each way): the faster of
    # the two timings is its latency (a loopback probe under load timed the 256 B one at
    # 2.8 ms and the 16 B one at 0.24 ms, which priced PowerSGD's step +195%)
    best["all_reduce"][0] = min(best["all_reduce"][0], small)
    wake = wake_seconds()
    # the median of 10 chains, not the faster of two probes: a chain's time is what the job's
    # thread meets (0.3-3 ms a top-k call from one chain to the next here), and the faster of
    # two probes priced gpt-tiny's top-k step at 35 ms against 59 measured
    per_tensor = reduce_seconds(specs, repeats=2 * REPEATS)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps({"fits": {k: list(v) for k, v in best.items()},
                                          "small_s": small, "wake_s": wake,
                                          "reduce": per_tensor}))
    dist.barrier()
    dist.destroy_process_group()


WORKS = (0.1e-3, 0.3e-3, 1e-3, 3e-3)  # compute before the wait: tp's half block .. a stage


def wake_seconds(works=WORKS, repeats: int = 15) -> list[list[float]]:
    """[[work_s, extra_s], ...]: the extra seconds of a blocking collective that follows
    work_s of compute, over the same call back to back (timed here first): the waiting rank's thread
    sleeps, its (virtual) core idles, and waking it costs this much. Measured here with 2
    gloo ranks: per-call medians of 0.2-2 ms against 0.3 ms back to back, varying from one
    probe to the next and with the work before the call, so each work's mean (10% trimmed
    each side) is kept. The job pays it at every blocking wait: tp's all-reduces, pp's
    receives, the step's small all-reduce, DataParallel's final wait."""
    import time
    import torch
    import torch.distributed as dist
    a, x = torch.randn(64, 64), torch.zeros(4)
    out = []
    for _ in range(3):
        dist.all_reduce(x)
    back = []
    for _ in range(repeats):
        t = time.perf_counter()
        dist.all_reduce(x)
        back.append(time.perf_counter() - t)
    for work_s in works:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < work_s:  # how many matmuls make work_s here
            a @ a
            n += 1
        ts = []
        for _ in range(repeats):
            for _ in range(n):
                a @ a
            t = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t)
        ts.sort()
        cut = len(ts) // 10
        out.append(statistics.mean(ts[cut:len(ts) - cut]))
    w = torch.tensor(out + [statistics.median(back)], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    w = w.tolist()
    return [[work_s, max(0.0, v - w[-1])] for work_s, v in zip(works, w)]


def probe_argv(path: str, pause: bool, specs=()) -> list[str]:
    return ["-c", "from pyfast.plan.calibrate import link_probe; "
            f"link_probe({path!r}, {pause}, {sorted(set(specs))!r})"]


def probe_link(link: str, timeout: float = 180, specs=()) -> dict:
    """The link model of 2 gloo ranks inside a fresh namespace whose loopback is shaped to
    `link` ("1gbit", "100mbit": pyfast.netns, as pyfast.ablate runs its cells; needs
    root), pausing before its large calls as steps do (a token bucket refills between them)."""
    from pyfast import netns
    netns.rate_bps(link)  # a bad link string fails before anything starts
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "link.json")
        netns.run_ranks(probe_argv(path, True, specs), 2, link, timeout)
        fit = json.loads(Path(path).read_text())
    # the bucket itself (timing.Link._bucket_s): tc's rate in bytes/s and its burst
    fit["tbf"] = [netns.rate_bps(link) / 8, netns.BURST_BYTES]
    return fit


def measure_loopback_link(timeout: float = 120, specs=()) -> dict:
    """The link model of 2 gloo ranks on plain loopback (2 child processes)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "link.json")
        _child(probe_argv(path, False, specs), timeout, world=2)
        return json.loads(Path(path).read_text())


def cp_probe(path: str, model: str, seq: int, micro_batch: int, method: str,
             precision: str) -> None:
    """A rank of the cp block probe (env://, gloo, world = cp): pyfast's Block under
    context_parallel (zigzag, as the job) on this rank's seq/cp tokens, forward and backward
    timed (medians, max over ranks); rank 0 writes [forward_s, backward_s] to `path`. The
    ring's attention runs its own kernels and merges, not the local causal SDPA: gpt-tiny's
    cp2 step measured 44 ms against 22 predicted from the local block."""
    import datetime
    import torch
    import torch.distributed as dist
    from pyfast import models
    from pyfast.train.job import AMP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    m = models.build(model, 256, seq)
    m.context_parallel(dist.group.WORLD, layout="zigzag", method=method)
    block = m[1]
    fwd = torch.autocast("cpu", dtype=AMP[precision])(block.forward) if precision in AMP \
        else block
    s = seq // dist.get_world_size()
    fs, bs = [], []
    for i in range(REPEATS + 2):
        x = torch.randn(micro_batch, s, m.cfg.d_model, requires_grad=True)
        dist.barrier()
        t0 = time.perf_counter()
        y = fwd(x)
        t1 = time.perf_counter()
        y.backward(torch.randn_like(y))
        t2 = time.perf_counter()
        if i > 1:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
    w = torch.tensor([statistics.median(fs), statistics.median(bs)], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(w.tolist()))
    dist.destroy_process_group()


def measure_cp_blocks(shape: ModelShape, work: Workload, plans, timeout: float = 180) -> dict:
    """{compute_key + ":cp": [forward_s, backward_s]} of each cp plan's block (tp 1), timed on
    cp gloo ranks on loopback: the ring's (or Ulysses') compute with its loopback traffic."""
    out = {}
    for plan in plans:
        key = timing.compute_key("block", plan, work) + ":cp"
        if plan.cp == 1 or plan.tp > 1 or key in out:
            continue
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "cp.json")
            argv = ["-c", "from pyfast.plan.calibrate import cp_probe; cp_probe("
                    f"{path!r}, {gpt_model_flag(replace(shape, layers=1))!r}, {work.seq}, "
                    f"{plan.micro_batch}, {plan.cp_method!r}, {work.precision!r})"]
            _child(argv, timeout, world=plan.cp)
            out[key] = json.loads(Path(path).read_text())
    return out


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
    dist.destroy_process_group()


def _child(argv: list[str], timeout: float, world: int = 1) -> None:
    """`python *argv` as `world` ranks of one gloo group (env://) on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, *argv], env={**env, "RANK": str(r),
                                                            "LOCAL_RANK": str(r)})
             for r in range(world)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"{' '.join(argv)[:80]}: exit codes {codes}")


def measure_job(shape: ModelShape, work: Workload, cluster: Cluster, micro_batch: int,
                timeout: float = 180) -> float:
    """The seconds a step of the job costs beyond its modules' compute and the optimizer (the
    batch, zero_grad, the norm pass, the scheduler, Python between layers): a 1-rank Job's
    measured step minus predict_time of the same 1-rank plan with `cluster`. What the ranks
    of one machine cost each other (measured here: two 1-rank gpt-tiny jobs at once step in
    16 ms against 7.0 ms alone, on the 2 cores) is not in it: refit() from a run has it."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "job.json")
        argv = ["-c", "from pyfast.plan.calibrate import job_probe; job_probe("
                f"{path!r}, {gpt_model_flag(shape)!r}, {work.seq}, {micro_batch}, "
                f"{work.precision!r})"]
        _child(argv, timeout)
        step = json.loads(Path(path).read_text())["step_s"]
    one = Plan(micro_batch=micro_batch)
    pred = timing.predict_time(shape, one, Workload(work.seq, micro_batch, work.precision),
                               cluster)
    return max(0.0, step - pred["step_s"])


def default_plans(shape: ModelShape, work: Workload, world: int = 2) -> list[Plan]:
    out = []
    for tp in (1, world):
        for cp in (1, world):
            if tp * cp <= world and work.global_batch % (world // (tp * cp)) == 0:
                out.append(Plan(dp=world // (tp * cp), tp=tp, cp=cp,
                                micro_batch=work.global_batch // (world // (tp * cp))))
    return out


def measure(shape: ModelShape, work: Workload, cluster: Cluster, link: str = "loopback",
            plans=None, link_model: dict | None = None) -> Cluster:
    """This machine's numbers for these plans (default: dp/tp/cp over 2 ranks, one micro-batch):
    compute at each plan's local shape, the link (plain loopback, or a namespace shaped to
    `link` by probe_link; link_model: one already measured), codec seconds of the plans'
    compressors. The result's calibration holds them for both intra and inter links (2 ranks
    on one machine)."""
    plans = list(plans) if plans else default_plans(shape, work)
    if link_model is None:
        specs = [p.compress for p in plans]
        link_model = measure_loopback_link(specs=specs) if link == "loopback" else \
            probe_link(link, specs=specs)
    cal = dict(cluster.calibration)
    cal.update(measure_compute(shape, work, plans))
    cal["compute"].update(measure_cp_blocks(shape, work, plans))
    specs = {p.compress for p in plans} | {p.param_compress for p in plans}
    cal["codec"] = {**cal.get("codec", {}), **measure_codecs(specs, shape)}
    cal["link_intra"] = cal["link_inter"] = link_model
    # the communication's CPU work (gloo's copies through the kernel, the codec): on this
    # machine's cores it competes with compute (cluster.gpu "cpu": 2 ranks x 2 threads)
    cal["link_cpu"] = link_model if link == "loopback" else measure_loopback_link()
    cal["cpu_contention"] = 1.0 if cluster.gpu.name == "cpu" else 0.0
    cal["link"] = link
    mb = max(p.micro_batch for p in plans if p.cp == 1 and p.tp == 1) if any(
        p.cp == 1 and p.tp == 1 for p in plans) else plans[0].micro_batch
    cal["step_overhead_s"] = measure_job(shape, work, cluster.replace(calibration=cal), mb)
    return cluster.replace(calibration=cal)


# ---------------------------------------------------------------- refit from a run
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
