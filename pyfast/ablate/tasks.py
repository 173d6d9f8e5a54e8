"""What a cell trains. Both tasks have the main job's face (train_step(step) -> record,
evaluate(), probe_batch(), loss_fn, net, dp, opt, close()), so the cell runner measures them
alike:

- gpt-tiny / gpt-small: pyfast.train.job.Job itself, the GPT on the stdlib corpus that
  `pyfast train` runs (AdamW, warm-up + cosine, clipping), with DataParallel over every rank.
- teacher: a student MLP shaped like a real model (LayerNorm, odd widths, biases) regressing a
  fixed random teacher whose input features span 300x in scale, so gradients of very different
  sizes sit side by side in one bucket: seconds per cell, for tests.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyfast.parallel import DataParallel
from pyfast.perf import clock, device_of



def build(cell: dict, job: dict, device: torch.device):
    if cell["task"] == "teacher":
        return Teacher(cell, job, device)
    from pyfast.train.config import TrainConfig, check
    from pyfast.train.job import Job
    world = dist.get_world_size()
    cfg = TrainConfig(model=cell["task"], dp=world, compress=cell["spec"],
                      error_feedback="off" if cell["error_feedback"] == "off" else "on",
                      bucket_mb=cell["bucket_mb"], steps=cell["steps"], batch=job["batch"],
                      seq=job["seq"], lr=job["lr"], seed=cell["seed"], eval_every=0,
                      out=job["scratch"], timeout=job["timeout"])
    check(cfg, world)
    j = Job(cfg, device)
    j.probe_batch = lambda: tuple(t.to(device) for t in j.batches.next())
    return j


def _mlp(d_in: int, d_out: int) -> nn.Module:
    # odd widths (none divides a 256-element compressor block) and a LayerNorm, as in real models
    return nn.Sequential(nn.Linear(d_in, 200), nn.LayerNorm(200), nn.GELU(), nn.Linear(200, 200),
                         nn.GELU(), nn.Linear(200, d_out))


class Teacher:
    D_IN, D_OUT = 48, 10

    def __init__(self, cell: dict, job: dict, device: torch.device):
        self.device, self.seed = device, cell["seed"]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.batch = job["batch"]
        torch.manual_seed(10_000 + self.seed)
        self.teacher = _mlp(self.D_IN, self.D_OUT).to(device)
        # features 300x apart: the first inputs' weights get gradients ~300x the others'
        self.scale = torch.logspace(0, math.log10(300), self.D_IN, device=device)
        torch.manual_seed(self.seed)
        model = _mlp(self.D_IN, self.D_OUT).to(device)
        self.dp = DataParallel(model, cell["spec"], error_feedback=cell["error_feedback"] != "off",
                               check_finite=False,
                               **({"bucket_mb": cell["bucket_mb"]} if cell["bucket_mb"] else {}))
        self.net = self.dp
        self.opt = torch.optim.Adam(model.parameters(), lr=job["lr"])
        self.step_no = 0

    def _data(self, step: int, split: int = 0):
        """Global batch `step` of the seed's stream; this rank's contiguous slice of it."""
        g = torch.Generator().manual_seed(self.seed * 10 ** 9 + split * 10 ** 8 + step)
        x = torch.randn(self.batch, self.D_IN, generator=g).to(self.device) * self.scale
        with torch.no_grad():
            y = self.teacher(x / self.scale.mean())
        per = self.batch // self.world
        return x[self.rank * per:(self.rank + 1) * per], y[self.rank * per:(self.rank + 1) * per]

    def loss_fn(self, out, y):
        return F.mse_loss(out, y) / y.var().clamp_min(1e-12)  # 1.0 = predicting the mean

    def probe_batch(self):
        self.step_no += 1
        return self._data(10 ** 6 + self.step_no)

    def train_step(self, step: int) -> dict:
        dev = device_of(self.dp.module)  # clock: on CUDA, after the queued work
        t0 = clock(dev)
        x, y = self._data(step)
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.net(x), y)
        loss.backward()
        waited = self.dp.last_wait_s
        self.opt.step()
        tc = clock(dev)
        v = loss.detach().double().reshape(1) / self.world
        dist.all_reduce(v)  # the mean loss, the same number (and NaN verdict) on every rank
        waited += clock(dev) - tc
        step_s = clock(dev) - t0
        return {"step": step, "loss": float(v), "step_ms": 1e3 * step_s,
                "compute_ms": 1e3 * (step_s - waited), "exposed_comm_ms": 1e3 * waited}

    @torch.no_grad()
    def evaluate(self) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i in range(4):
            x, y = self._data(i, split=1)
            total += self.loss_fn(self.dp.module(x), y).double() / 4 / self.world
        dist.all_reduce(total)
        return float(total)

    def close(self) -> None:
        self.dp.close()
