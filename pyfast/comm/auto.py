"""compressor="auto": per bucket, the cheapest of none / 16-bit / the quantizers, by measurement.

Agarwal et al. (MLSys'22) found gradient compression beat optimized synchronous SGD in only 6
of 200+ setups, mostly because compression compute ate the bandwidth it saved; so the choice
is measured, not assumed, and the 16-bit reduction is the bar:

1. steps [0, WARMUP): every bucket reduces in fp16 (the baseline); step WARMUP-1 is timed on
   the communication thread, giving each bucket's fp16 time t16.
2. end of that step: for each candidate, time its encode + decode on the bucket's own
   gradient and its relative error there (pyfast.comm.cost); the wire-bound part of t16 scales
   with wire bytes, and the error costs extra steps to the same loss (cost.convergence_seconds:
   int4 took 8.5% more steps on gpt-tiny, bench/results/ablate):
       cost(c) = (t16 - codec16) * wire(c) / wire(fp16) + codec(c) * passes
                 + STEPS_PER_ERROR * error(c) * step_time * bucket's share of the gradient
   Costs are all-reduced (max over ranks) so every rank picks the same; a candidate must beat
   fp16 by MARGIN to be picked.
3. the next step runs the picks and is timed; any bucket whose pick was slower than its fp16
   time (max over ranks) goes back to fp16.
4. the step after runs every bucket uncompressed ("none") and is timed: a bucket whose plain
   reduction took no longer than what step 3 left it with reduces uncompressed for good (lossless
   and at least as fast). Predicted costs miss this where the link is fast and the codec
   competes with compute or only launches work: on one H200 (a NCCL world of one), auto ran at
   0.69-0.87x DDP's step rate before this step (bench/results/gpu_h200_dp), on this 2-core EPYC's
   loopback at 0.92-0.98x with 37-44 MB a step where "none" sends 87.
So auto is never slower than the faster of 16-bit and uncompressed by more than the noise of one
measurement, and it decides once, then stays out of the way.
"""
from __future__ import annotations


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
        # step WARMUP's result per bucket (the choice it leaves, and that time) while step
        # WARMUP + 1 tries "none" everywhere
        self.trial = list(self.choice)
        self.kept_s = [0.0] * len(buckets)
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

    def after_step(self, seconds: list[float]) -> None:
        """Called at the end of every synced step with each bucket's reduction time."""
        if self.fixed:
            return
        # the step's time: the gradients' device synchronized (on CUDA, else the launches)
        t, self._last = self._last, clock(self.buckets[0].flat.device if self.buckets else None)
        if self.step == WARMUP - 1:
            *self.t16, self.step_s = self._agree(list(seconds) + [self._last - t])
            self._decide()
        elif self.step == WARMUP:
            took = self._agree(seconds)
            for i, b in enumerate(self.buckets):
                slower = took[i] > self.t16[i]
                self.report[i].update(measured=took[i], reverted=slower and self.choice[i] != "fp16")
                if slower:
                    self.choice[i] = "fp16"
                self.kept_s[i] = min(took[i], self.t16[i])
            self.trial, self.choice = list(self.choice), ["none"] * len(self.buckets)
        elif self.step == WARMUP + 1:  # every bucket ran uncompressed this step
            took = self._agree(seconds)
            for i, b in enumerate(self.buckets):
                plain = took[i] <= self.kept_s[i]
                self.report[i].update(none_s=took[i], none=plain)
                self.choice[i] = "none" if plain else self.trial[i]
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
        self.report = []
        for i, b in enumerate(self.buckets):
            row = dict(zip(CANDIDATES, costs[i * k:(i + 1) * k]))
            best = min(row, key=row.get)
            self.choice[i] = best if row[best] < MARGIN * row["fp16"] else "fp16"
            self.report.append({"bucket": b.name, "fp16_s": self.t16[i], "predicted": row,
                                "choice": self.choice[i]})
