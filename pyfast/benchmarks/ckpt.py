"""What a checkpoint costs the training step (`pyfast bench ckpt`): the job's own step
(pyfast.train.job.Job, --dp 2, 2 gloo ranks x 1 thread, plain loopback) with a checkpoint every
K steps written blocking (checkpoint.save), with --ckpt-async (ckpt_async.Checkpointer: DCP
async_save in a thread) and with none, side by side in one launch.

    python -m pyfast.benchmarks.ckpt [--model gpt-small] [--every 5] [--rounds 3]
                                     [--executors thread,process] [--out bench/results/ckpt]

One Job per rank trains on through every segment; a segment is `checkpoints` x K steps of one
mode with a checkpoint after every K-th (the last one's write, for async, is waited for after
the segment: in a longer run it overlaps the next K steps, as every earlier one did here). The
modes take turns (round robin, `rounds` times) so they see the same load; a segment's time is
the slowest rank's, and a mode's step time the median over its rounds of segment time / steps.

    added per checkpoint = (step with checkpoints - step without) x K
    target (issue 35): async's added <= 10% of the blocking save's added.

DCP fsyncs every file it writes (FileSystemWriter(sync_files=True)), so each blocking save
waits for the disk, not just the page cache. Before anything is timed, each mode saves once
(first-use costs: DCP's imports, the writer's gloo group, a process executor's start) and the
async checkpoint is checked to load back equal to the state it was taken from.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time

from pyfast import netns, perf
from pyfast._io import atomic_write_text

TARGET = 0.10  # async's added step time per checkpoint / the blocking save's (issue 35)


def _segment(job, saver, step, k, n, out):
    """n x k steps with a checkpoint (saver, None: none) after every k-th; (seconds, next step,
    the saves' records)."""
    import torch.distributed as dist
    dist.barrier()
    t0, recs = time.perf_counter(), []
    for i in range(n * k):
        job.train_step(step)
        if saver is not None:
            saver.poll()
            if (i + 1) % k == 0:
                recs.append(saver.save(job, out, step, keep_last=1))
        step += 1
    return time.perf_counter() - t0, step, recs


def _check_roundtrip(job, path) -> float:
    """The largest |difference| between the job's model now and what `path` loads back."""
    import torch

    from pyfast.train import checkpoint as ck
    want = job.state(full=False)
    got = {"model": {k: torch.empty_like(v) for k, v in want["model"].items()}}
    ck.load(got, path)
    return max(float((got["model"][k] - v).abs().max()) for k, v in want["model"].items())


def _worker() -> None:
    import torch
    import torch.distributed as dist

    from pyfast.train import checkpoint as ck
    from pyfast.train.ckpt_async import Checkpointer
    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    j = json.loads(os.environ["PYFAST_CKPT"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=j["timeout"]))
    rank, cpu = dist.get_rank(), torch.device("cpu")
    k, n = j["every"], j["checkpoints"]
    cfg = TrainConfig(model=j["model"], dp=2, batch=j["batch"], seq=j["seq"], steps=10**6)
    job = Job(cfg, cpu)
    modes = ["none", "blocking"] + [f"async {e}" for e in j["executors"]]
    savers = {"none": None, "blocking": Checkpointer(False, cpu)}
    savers.update({f"async {e}": Checkpointer(True, cpu, executor=e) for e in j["executors"]})
    outs = {m: os.path.join(j["dir"], m.replace(" ", "_")) for m in modes}
    step, diff = 1, 0.0
    for m in modes[1:]:  # first use, untimed; then the written state read back
        _, step, _ = _segment(job, savers[m], step, 1, 1, outs[m])
        savers[m].finish()
        diff = max(diff, _check_roundtrip(job, ck.latest(outs[m])[1]))
    times = {m: [] for m in modes}
    saves = {m: [] for m in modes}
    for _ in range(j["rounds"]):
        for m in modes:
            t, step, recs = _segment(job, savers[m], step, k, n, outs[m])
            slow = torch.tensor(t, dtype=torch.float64)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            times[m].append(float(slow) / (k * n))
            if savers[m] is not None:
                savers[m].finish()  # untimed: the last write's tail (see the module)
                saves[m] += recs
    if rank == 0:
        nbytes = sum(f.stat().st_size for f in ck.latest(outs["blocking"])[1].iterdir())
        rows = []
        for m in modes:
            r = {"config": m, "step_s": statistics.median(times[m]), "steps_s": times[m]}
            if saves[m]:
                mean = lambda key: statistics.mean(x.get(key, 0.0) for x in saves[m])  # noqa
                r.update(blocked_ms=mean("ckpt_blocked_ms"), stage_ms=mean("ckpt_stage_ms"),
                         wait_ms=mean("ckpt_wait_ms"), write_ms=mean("ckpt_write_ms"))
            rows.append(r)
        atomic_write_text(j["out"], json.dumps({"rows": rows, "ckpt_bytes": nbytes,
                                                "n_params": job.n_params,
                                                "roundtrip_max_diff": diff}))
    for s in savers.values():
        if s is not None:
            s.close()
    job.close()
    netns.finish_group()


def run(model: str = "gpt-small", every: int = 5, checkpoints: int = 2, rounds: int = 3,
        batch: int = 8, seq: int = 256, executors=("thread",), timeout: float = 900) -> dict:
    with tempfile.TemporaryDirectory(prefix="pyfast-ckpt-", dir=os.environ.get("PYFAST_CKPT_DIR")
                                     ) as d:
        j = dict(model=model, every=every, checkpoints=checkpoints, rounds=rounds, batch=batch,
                 seq=seq, executors=list(executors), timeout=timeout, dir=d,
                 out=os.path.join(d, "r.json"))
        netns.run_ranks(["-c", "from pyfast.benchmarks.ckpt import _worker; _worker()"], 2,
                        "loopback", timeout, env={"PYFAST_CKPT": json.dumps(j)})
        with open(j["out"]) as f:
            res = json.load(f)
        shutil.rmtree(d, ignore_errors=True)
    if res["roundtrip_max_diff"] != 0.0:
        raise RuntimeError(f"a checkpoint did not load back equal: max diff "
                           f"{res['roundtrip_max_diff']}")
    base = next(r["step_s"] for r in res["rows"] if r["config"] == "none")
    block = next(r for r in res["rows"] if r["config"] == "blocking")
    block_added = (block["step_s"] - base) * every
    for r in res["rows"]:
        r["added_per_ckpt_s"] = (r["step_s"] - base) * every
        r["vs_blocking"] = r["added_per_ckpt_s"] / block_added if block_added > 0 else None
        # the time the step is held, directly (what a GPU run pays: there the write thread
        # runs on idle host cores); the step-time difference above also counts the write's
        # competition for this machine's two cores, and the load's noise
        if "blocked_ms" in r:
            r["blocked_vs_blocking"] = r["blocked_ms"] / block["blocked_ms"]
    res.update(machine=perf.machine(), date=datetime.date.today().isoformat(), model=model,
               every=every, checkpoints=checkpoints, rounds=rounds, batch=batch, seq=seq,
               target=TARGET)
    return res


def table(res: dict):
    t = perf.rich_table(
        f"checkpoint every {res['every']} steps: {res['model']} ({res['n_params'] / 1e6:.1f}M "
        f"parameters, checkpoint {res['ckpt_bytes'] / 1e6:.0f} MB), --dp 2, 2 ranks x 1 "
        f"thread, batch {res['batch']} x {res['seq']}; {res['checkpoints']} checkpoints a "
        f"segment, median of {res['rounds']} rounds (round robin), slowest rank; target: "
        f"async adds <= {res['target']:.0%} of the blocking save's time", res,
        ("config", "step ms", "added per ckpt ms", "x blocking's added", "step blocked ms",
         "x blocking's blocked", "staging ms", "waiting ms", "write ms (background)"),
        left=("config",))
    f = lambda r, k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
    for r in res["rows"]:
        t.add_row(r["config"], f"{r['step_s'] * 1e3:.1f}", f"{r['added_per_ckpt_s'] * 1e3:.1f}",
                  "-" if r["vs_blocking"] is None else f"{r['vs_blocking']:.3f}",
                  f(r, "blocked_ms"),
                  f"{r['blocked_vs_blocking']:.3f}" if "blocked_vs_blocking" in r else "-",
                  f(r, "stage_ms") if "async" in r["config"] else "-",
                  f(r, "wait_ms") if "async" in r["config"] else "-",
                  f(r, "write_ms") if "async" in r["config"] else "-")
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench ckpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--every", type=int, default=5, help="K: steps between checkpoints")
    p.add_argument("--checkpoints", type=int, default=2, help="checkpoints per segment")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--executors", default="thread", help="async_save's executors, comma list: "
                   "thread (the job's), process")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    return perf.finish(run(a.model, a.every, a.checkpoints, a.rounds, a.batch, a.seq,
                           a.executors.split(",")), table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
