"""compressor="auto": per bucket, the cheapest of none / 16-bit / the quantizers, by measurement.

Agarwal et al. (MLSys'22) found gradient compression beat optimized synchronous SGD in only 6
of 200+ setups, mostly because compression compute ate the bandwidth it saved; so the choice
is measured, not assumed, and the 16-bit reduction is the bar:

1. steps [0, WARMUP): every bucket reduces in fp16 (the baseline); step WARMUP-1 is timed on
   the communication thread, giving each bucket's fp16 time t16, and as a whole step (S16).
2. step WARMUP runs every bucket uncompressed ("none") and is timed the same way (tn, Sn),
   with the time the step waited for its reductions after backward (exposed). Every bucket
   reduces uncompressed for good, decided here, when either says no codec can pay: the
   exposed wait was under 1 - MARGIN of the step (compression only shortens what is
   exposed), or the 16-bit step was not 1/MARGIN faster than the uncompressed one (halving
   the bytes bought nothing, and every other codec costs more than a cast). Two tests, since
   one step's time on a loaded machine moves by more than the margin (issue 32: 2 ranks
   under a load average of 23, the fp16 step came out faster and auto compressed at batch
   8). Whole steps are the measure because a codec's CPU competes with compute, which the
   communication thread's bucket times do not see: on this 2-core EPYC's loopback (2 ranks x 1 thread,
   gpt-small, batch 2) the per-bucket rule alone kept int4/int8/fp16 on 3-6 of 10 buckets from
   run to run and auto ran at 0.92-0.98x DDP's step rate (docs/benchmarks.md, issue 32).
3. otherwise, for each candidate: time its encode + decode on the bucket's own gradient and its
   relative error there (pyfast.comm.cost); the wire-bound part of t16 scales with wire bytes,
   and the error costs extra steps to the same loss (cost.convergence_seconds: int4 took 8.5%
   more steps on gpt-tiny, bench/results/ablate):
       cost(c) = (t16 - codec16) * wire(c) / wire(fp16) + codec(c) * passes
                 + STEPS_PER_ERROR * error(c) * step_time * bucket's share of the gradient
   Costs are all-reduced (max over ranks) so every rank picks the same; a candidate must beat
   fp16 by MARGIN to be picked.
4. the next step runs the picks and is timed; each bucket keeps the fastest of its pick, fp16
   and none as measured (max over ranks), and the choice is fixed. On one H200 (a NCCL world of
   one) auto ran at 0.69-0.87x DDP's step rate before "none" was measured at all
   (bench/results/gpu_h200_dp).
So auto is never slower than the faster of 16-bit and uncompressed by more than the noise of one
measurement, and it decides once, then stays out of the way: a bucket fixed at "none" is
reduced as compressor "none" reduces it (averaged on its way in, then summed).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import pyfast.compress as C
from pyfast.comm import cost
from pyfast.comm.dry import read
from pyfast.perf import clock

CANDIDATES = ["fp16", "none", "bf16", "int8", "fp8", "int4"]
WARMUP = 2
MARGIN = 0.9  # a pick must be predicted at least 10% faster than fp16: noise is ~5% here


def _wire(c: C.Compressor, n: int) -> int:
    w = c.wire_bytes(n)
    return n * 4 if w is None else w


class AutoSelector:
    def __init__(self, buckets, group, error_feedback: bool):
        self.buckets, self.group, self.step = buckets, group, 0
        self.world = dist.get_world_size(group)
        self.fixed = False
        self.made = {}
        dev = buckets[0].flat.device if buckets else None  # the feedback memory's, loads too
        for spec in CANDIDATES:
            self.made[spec] = C.wrap(C.get(spec), error_feedback, dev)
        self.choice = ["fp16"] * len(buckets)
        self.t16 = [0.0] * len(buckets)
        self.tnone = [0.0] * len(buckets)  # step WARMUP's bucket times, all uncompressed
        self.report: list[dict] = []
        self.step_s, self._last = 0.0, None  # the whole step's time, between after_step calls

    def compressor(self, b):
        return self.made[self.choice[b.index]]

    def _agree(self, values: list[float]) -> list[float]:
        if not self.buckets:  # every rank has the same buckets: none agree on nothing
            return []
        # on the gradients' device: the backend that reduces them carries the timings too
        t = torch.tensor(values, dtype=torch.float64, device=self.buckets[0].flat.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return read(t, list(values), self.group)  # a dry run: every rank measured these

    def after_step(self, seconds: list[float], exposed=None) -> None:
        """Called at the end of every synced step with each bucket's reduction time; exposed():
        the seconds the step waited for its reductions after backward (read at one step only:
        on CUDA reading it waits for the stream)."""
        if self.fixed:
            return
        # the step's time: the gradients' device synchronized (on CUDA, else the launches)
        t, self._last = self._last, clock(self.buckets[0].flat.device if self.buckets else None)
        if self.step == WARMUP - 1:  # the fp16 step, timed; the next runs uncompressed
            *self.t16, self.step_s = self._agree(list(seconds) + [self._last - t])
            self.choice = ["none"] * len(self.buckets)
        elif self.step == WARMUP:  # every bucket ran uncompressed this step
            waited = exposed() if exposed is not None else math.inf
            *self.tnone, plain_s, waited = self._agree(list(seconds) + [self._last - t, waited])
            self.report = [{"bucket": b.name, "fp16_s": self.t16[i], "none_s": self.tnone[i]}
                           for i, b in enumerate(self.buckets)]
            # halving the bytes paid, and enough of the step is exposed for a codec to win
            if self.step_s < MARGIN * plain_s and waited >= (1 - MARGIN) * plain_s:
                self._decide()
            else:
                self.choice = ["none"] * len(self.buckets)
                for r in self.report:
                    r.update(choice="none", why=f"16-bit step {1e3 * self.step_s:.1f} ms, "
                                                f"uncompressed {1e3 * plain_s:.1f} ms, "
                                                f"{1e3 * waited:.1f} of it exposed")
                self.fixed = True
        elif self.step == WARMUP + 1:  # the picks' step
            took = self._agree(seconds)
            for i, r in enumerate(self.report):
                times = {self.choice[i]: took[i]}
                times.setdefault("fp16", self.t16[i])
                times.setdefault("none", self.tnone[i])
                best = min(times, key=times.get)  # a tie keeps the pick, then fp16
                r.update(measured=took[i], reverted=best != self.choice[i], choice=best)
                self.choice[i] = best
            self.fixed = True
        self.step += 1

    def _decide(self) -> None:
        passes = 2.0 if self.world > 2 else 1.0 + (self.world - 1) / 2  # two-phase vs allgather
        total = sum(b.flat.numel() for b in self.buckets)
        costs = []
        for b in self.buckets:
            n = b.flat.numel()
            codec = {s: sum(cost.codec_seconds(C.get(s), b.flat)) for s in CANDIDATES}
            slower = {s: cost.convergence_seconds(cost.relative_error(C.get(s), b.flat),
                                                  self.step_s, n / total) for s in CANDIDATES}
            wire16 = _wire(C.get("fp16"), n)
            link = max(self.t16[b.index] - codec["fp16"] * passes, 1e-9)
            costs += [(link * _wire(C.get(s), n) / wire16 + codec[s] * passes
                       if s != "none" else link * 2) + slower[s] for s in CANDIDATES]
        costs = self._agree(costs)  # identical decisions on every rank
        k = len(CANDIDATES)
        for i, b in enumerate(self.buckets):
            row = dict(zip(CANDIDATES, costs[i * k:(i + 1) * k]))
            best = min(row, key=row.get)
            self.choice[i] = best if row[best] < MARGIN * row["fp16"] else "fp16"
            self.report[i].update(predicted=row, pick=self.choice[i])

    def state_dict(self) -> dict:
        return {"spec": "auto", "choice": list(self.choice), "fixed": self.fixed,
                "step": self.step, "t16": list(self.t16), "tnone": list(self.tnone),
                "step_s": self.step_s,
                "state": {s: c.state_dict() for s, c in self.made.items()}}

    def load_state_dict(self, state: dict) -> None:
        if len(state["choice"]) != len(self.choice):
            raise ValueError(f"compression state has {len(state['choice'])} buckets, this "
                             f"DataParallel has {len(self.choice)} (another bucket_mb or model?)")
        for s, st in state["state"].items():
            self.made[s].load_state_dict(st)
        if not state["fixed"] and "tnone" not in state:
            # saved mid-decision by the protocol before issue 32 (another order of steps):
            # decide again from the first step; the fp16 memories loaded above carry over
            return
        self.choice, self.fixed, self.step = list(state["choice"]), state["fixed"], state["step"]
        self.t16 = list(state["t16"])
        self.tnone = list(state.get("tnone", [0.0] * len(self.choice)))
        self.step_s = state.get("step_s", 0.0)
