"""The rank side of an ablation: one launch of the ranks on one link runs the cells given in
PYFAST_ABLATE (JSON) one after another. Rank 0 writes each step of a cell to
DIR/cells/<cell>.jsonl as it finishes (the runner shows it live) and the cell's row to
DIR/cells/<cell>.json when it is done (the runner appends it to results.csv).

After the steps and the validation loss, probes measure what the cost model needs on this
very model and link: a step with no reduction (compute, when each bucket's gradients are
ready), each bucket's encode and decode on its own gradient, and the link's primitives
(once per launch). The prediction is made from those, never from the step times it predicts.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import pyfast
import pyfast.compress as C
from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast.comm import cost
from pyfast.errors import NonFiniteGradient
from pyfast.train.job import NonFiniteError
from pyfast.train.telemetry import bytes_written

from .schema import SMOOTH, STEP_KEYS
from .tasks import build

now = time.perf_counter


def _hwm_reset() -> None:
    # "5" resets the peak RSS (VmHWM) of this process (Linux >= 4.0): each cell its own peak
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return math.nan


def _lo_bytes() -> int | None:
    """Bytes on this namespace's lo (all ranks' traffic), None on plain loopback (shared with
    everything else on the machine)."""
    if not os.environ.get("PYFAST_NETNS"):
        return None
    from pyfast.netns import lo_tx_bytes
    return lo_tx_bytes()


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _compressors(dp) -> list:
    return [dp.selector.compressor(b) if dp.selector else dp.compressor
            for b in dp.bucketer.buckets]


def probe(tj, link) -> dict:
    """What the cost model is given, measured on this model: when backward ends and when each
    bucket's gradients are ready (fwd + bwd under no_sync, gradient hooks), the whole step with
    no reduction (the task's own train_step under no_sync: batch, norm, the loss all-reduce, the
    optimizer, waiting for the slower rank), and each bucket's codec times; then the prediction:
    that step plus whatever communication backward could not hide (cost.predict_step)."""
    dp, world = tj.dp, dist.get_world_size()
    buckets = dp.bucketer.buckets
    seen: dict = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: seen.__setitem__(p, now()))
             for b in buckets for p in b.params]
    bwd, ready, full = [], [], []
    try:
        for _ in range(5):
            x, y = tj.probe_batch()
            tj.opt.zero_grad(set_to_none=True)
            seen.clear()
            dist.barrier()
            t0 = now()
            with dp.no_sync():
                tj.loss_fn(tj.net(x), y).backward()
            bwd.append(now() - t0)
            ready.append([max(seen[p] for p in b.params if p in seen) - t0 for b in buckets])
    finally:
        for h in hooks:
            h.remove()
    for i in range(9):  # 9: one slow step among 5 moved the median by 10 ms (noisy 2 cores)
        dist.barrier()
        with dp.no_sync():
            full.append(tj.train_step(10 ** 6 + i)["step_ms"] / 1e3)
    comps = _compressors(dp)
    parts = {"encode_s": 0.0, "decode_s": 0.0}
    bucket_s = []
    for b, c in zip(buckets, comps):
        pieces = ([b.flat[o:o + p.numel()].view(p.shape) for p, o in zip(b.params, b.offsets)]
                  if c.per_tensor else [b.flat])
        total = 0.0
        for piece in pieces:
            x = piece.clone().normal_()  # a fresh gradient-like tensor: codecs are data-blind
            # a fresh instance: the cell's own feedback memory and PowerSGD state stay as they are
            fresh = C.wrap(C.get(c.base.spec), c.feedback is not None)
            m = cost.comm_seconds(c, tuple(x.shape), world, link, cost.codec_seconds(fresh, x))
            total += m["total_s"]
            for k in parts:
                parts[k] += m[k]
        bucket_s.append(total)
    compute, whole = _max(statistics.median(bwd)), _max(statistics.median(full))
    ready = [_max(statistics.median(r)) for r in zip(*ready)]
    pred = cost.predict_step(compute, ready, [_max(s) for s in bucket_s], whole - compute)
    wire = sum(sum(cost.sent_bytes(c, p.shape, world) for p in b.params) if c.per_tensor
               else cost.sent_bytes(c, b.flat.shape, world) for b, c in zip(buckets, comps))
    return {"compute_ms": 1e3 * whole, "encode_ms": 1e3 * _max(parts["encode_s"]),
            "decode_ms": 1e3 * _max(parts["decode_s"]), "predicted_step_ms": 1e3 * pred["step_s"],
            "predicted_exposed_ms": 1e3 * pred["exposed_s"], "wire_bytes_per_step": wire}


def run_cell(cell: dict, job: dict, link, device) -> dict:
    rank0 = dist.get_rank() == 0
    path = os.path.join(job["dir"], "cells", cell["cell"])
    log = open(path + ".jsonl", "w") if rank0 else None
    _hwm_reset()
    row = {"status": "done", "reason": ""}
    tj = build(cell, job, device)
    steps, t_s, reached = [], 0.0, None
    try:
        for step in range(1, cell["steps"] + 1):
            lo, w0 = _lo_bytes(), bytes_written()
            rec = tj.train_step(step)
            rec["proc_bytes"] = bytes_written() - w0
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"step {step}: loss {rec['loss']}")
            if lo is not None:
                rec["lo_bytes"] = _lo_bytes() - lo
            rec["comm_s"] = sum(b.extra.get("seconds", math.nan) for b in tj.dp.bucketer.buckets)
            t_s += rec["step_ms"] / 1e3
            steps.append(rec)
            smooth = statistics.fmean(r["loss"] for r in steps[-SMOOTH:])
            if reached is None and smooth <= cell["target_loss"]:
                reached = (step, t_s)
            if rank0:
                out = {**rec, "smooth_loss": smooth, "t_s": t_s}
                log.write(json.dumps({k: out[k] for k in STEP_KEYS}) + "\n")
                log.flush()
        row["val_loss"] = tj.evaluate()
        row.update(probe(tj, link))
    except (NonFiniteError, NonFiniteGradient, FloatingPointError) as e:  # every rank alike
        row.update(status="diverged", reason=str(e).split(";")[0])
    finally:
        if log is not None:
            log.close()
    if steps:
        row.update(_summary(steps, reached))
    if tj.dp.selector is not None:
        row["auto_choice"] = ";".join(tj.dp.selector.choice)
    row["peak_rss_mb"] = _max(_hwm_mb())
    tj.close()
    return row


def _summary(steps: list[dict], reached) -> dict:
    after = steps[min(len(steps) - 1, 3):]  # steps 1-3: warm-up (allocations, auto's probes)
    med = lambda k: statistics.median(r[k] for r in after)  # noqa: E731
    out = {"final_loss": statistics.fmean(r["loss"] for r in steps[-SMOOTH:]),
           "reached": "yes" if reached else "no",
           "steps_to_target": reached[0] if reached else "",
           "time_to_target_s": reached[1] if reached else "",
           "train_s": sum(r["step_ms"] for r in steps) / 1e3,
           "step_ms": med("step_ms"), "exposed_comm_ms": med("exposed_comm_ms"),
           "comm_ms": 1e3 * med("comm_s"),
           "proc_bytes_per_step": med("proc_bytes")}
    if "lo_bytes" in steps[0]:
        out["lo_bytes_per_step"] = med("lo_bytes")
    return out


def serve() -> None:
    """A launched rank: join the default group, measure the link once, run the cells."""
    job = json.loads(os.environ["PYFAST_ABLATE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    device = torch.device("cpu")
    link = cost.measure_link(pause=bool(os.environ.get("PYFAST_NETNS")))  # tc tbf refills
    where = {"machine": perf.machine(), "torch": torch.__version__, "pyfast": pyfast.__version__,
             "python": platform.python_version()}
    for cell in job["cells"]:
        row = run_cell(cell, job, link, device)
        if dist.get_rank() == 0:
            row.update(where, timestamp=datetime.datetime.now().isoformat(timespec="seconds"))
            atomic_write_text(os.path.join(job["dir"], "cells", cell["cell"] + ".json"),
                              json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
