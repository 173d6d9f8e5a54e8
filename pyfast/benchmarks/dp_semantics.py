"""What DDP's semantics cost DataParallel a step, on `pyfast bench dp`'s model (9.4M
parameters, batch 128/rank, 2 ranks x 1 thread, gloo on loopback):

    pyfast bench dp_semantics --out bench/results/dp_semantics

Per compressor, three DataParallels over copies of the same model, stepped in turns (round
robin, the order rotated every round, so drift in the machine's load and the cost of
switching models hit all three alike), medians of the step:
- bare: without the DDP-semantics work (DataParallel._bare: no side band of used-parameter
  flags, no parameter check, no buffer broadcast; unused parameters would get zeros) and
  check_finite=False;
- semantics: with it, check_finite=False (unused-parameter detection + buffer broadcast: the
  issue's 2% target);
- default: with it and check_finite="skip" (adds the NaN/Inf check: with a block quantizer
  one read a block of the reduced buckets, and the staging of the error-feedback memory
  that a skipped step drops; before issue 25, a full pass and a copy of the memory: +5.6 to
  +8.8% of the int8 step).
The model has no buffers (as in bench dp), so the broadcast costs only the check that there is
nothing to send. The step medians move by a few percent from run to run on this shared
2-core machine, more than the work measured, so each part is also timed alone (_components)
and `parts / bare` is their sum over the bare step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast import netns

VARIANTS = ("bare", "semantics", "default")


def _worker() -> None:
    """One rank (netns.ranks' env), the job in PYFAST_DP_SEMANTICS (json); rank 0 writes out."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from pyfast.benchmarks.dp import build
    from pyfast.parallel.data import DataParallel
    job = json.loads(os.environ["PYFAST_DP_SEMANTICS"])
    specs, rounds, steps = job["specs"], job["rounds"], job["steps"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(128, 1024, generator=g), torch.randn(128, 1024, generator=g)
    out = {}
    for spec in specs:
        nets = {}
        for v in VARIANTS:
            net = DataParallel(build(), spec, check_finite="skip" if v == "default" else False)
            net._bare = v == "bare"
            nets[v] = (net, torch.optim.SGD(net.parameters(), lr=1e-3))
        times = {v: [] for v in VARIANTS}
        for r in range(rounds + 1):  # round 0 warms up
            k = r % len(VARIANTS)  # each variant takes each place in the round in turn
            for v in VARIANTS[k:] + VARIANTS[:k]:
                net, opt = nets[v]
                for _ in range(steps):
                    dist.barrier()
                    t0 = perf.clock(x.device)
                    opt.zero_grad()
                    nn.functional.mse_loss(net(x), y).backward()
                    opt.step()
                    if r:
                        times[v].append(perf.clock(x.device) - t0)
        out[spec] = {v: statistics.median(t) for v, t in times.items()}
        # after the timing: the variants took the same steps on the same data, so they must
        # hold the same weights (the semantics change no result on this model)
        bare = list(nets["bare"][0].parameters())
        out[spec]["max_param_diff"] = max(
            float((a - b).abs().max()) for v in VARIANTS[1:]
            for a, b in zip(nets[v][0].parameters(), bare))
        out[spec].update(_components(nets["semantics"][0], dist))
        for net, _ in nets.values():
            net.close()
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(out))
    netns.finish_group()


def _components(net, dist, n: int = 40) -> dict:
    """The semantics work timed alone (the step medians above differ by less than this
    machine's noise): the parameter check a forward runs, the used flags a bucket launch sets,
    and the side band's all-reduce (on the engine, as in a step, after a barrier)."""
    import torch

    def med(fn):
        ts = []
        for _ in range(n):
            dist.barrier()
            t0 = perf.clock(perf.device_of(net))
            fn()
            ts.append(perf.clock(perf.device_of(net)) - t0)
        return statistics.median(ts)

    def flags():
        for b in net.bucketer.buckets:
            net._band.mark_used(b.index, b.params)

    def side():  # on the engine (or comm's worker) as in a step
        net._band.reduce(net._engine, net._comm).wait()

    with torch.no_grad():
        return {"check_s": med(net._check_usable), "flags_s": med(flags), "side_s": med(side),
                "side_floats": len(net._band.flags)}


def run(specs=("int8", "none"), rounds: int = 5, steps: int = 6) -> dict:
    with tempfile.TemporaryDirectory() as d:
        job = {"specs": list(specs), "rounds": rounds, "steps": steps,
               "out": os.path.join(d, "r.json")}
        netns.run_ranks(["-c", "from pyfast.benchmarks.dp_semantics import _worker; _worker()"],
                        2, timeout=1800, env={"PYFAST_DP_SEMANTICS": json.dumps(job)})
        with open(job["out"]) as f:
            res = json.load(f)
    rows = {spec: {**t, "semantics_cost": t["semantics"] / t["bare"] - 1,
                   "default_cost": t["default"] / t["bare"] - 1,
                   "parts_cost": (t["check_s"] + t["flags_s"] + t["side_s"]) / t["bare"]}
            for spec, t in res.items()}
    return {"machine": perf.machine(), "world": 2, "link": "loopback", "batch": 128,
            "model": "bench dp MLP, 9.4M parameters", "rounds": rounds, "steps": steps,
            "rows": rows}


def table(res: dict) -> str:
    lines = [f"DDP-semantics cost per step, {res['model']}, 2 ranks x 1 thread, {res['link']}, "
             f"batch {res['batch']}/rank; medians of {res['rounds']} x {res['steps']} steps; "
             f"{res['machine']}",
             f"{'compressor':<11}{'bare ms':>9}{'semantics ms':>14}{'default ms':>12}"
             f"{'semantics cost':>16}{'default cost':>14}{'check ms':>10}{'flags ms':>10}"
             f"{'side band ms':>14}{'parts / bare':>14}"]
    for spec, r in res["rows"].items():
        lines.append(f"{spec:<11}{r['bare'] * 1e3:>9.1f}{r['semantics'] * 1e3:>14.1f}"
                     f"{r['default'] * 1e3:>12.1f}{r['semantics_cost']:>+16.1%}"
                     f"{r['default_cost']:>+14.1%}{r['check_s'] * 1e3:>10.3f}"
                     f"{r['flags_s'] * 1e3:>10.3f}{r['side_s'] * 1e3:>14.3f}"
                     f"{r['parts_cost']:>14.2%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench dp_semantics", description=__doc__)
    p.add_argument("--specs", default="int8,none")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    return perf.finish(run(a.specs.split(","), a.rounds, a.steps), table, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
