"""ZeroGradScaler: fp16 loss scaling for zero()'s optimizer (torch's ShardedGradScaler, fixed).

    model, opt = pyfast.parallel.zero(module, torch.optim.AdamW, stage=2, compressor="int8")
    scaler = ZeroGradScaler("cuda", optimizer=opt)        # found_inf agreed over the world
    with torch.autocast("cuda", torch.float16):
        loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update(); opt.zero_grad()

ZeroOptimizer's param_groups hold this rank's fp32 master shards, so torch's
torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (FSDP's: unscale and inf check of
the local shards, their found_inf all-reduced over process_group, one all-reduce of one flag
per device; a rank with no gradient shard gets a zero flag on the scale's device) is almost
right as it is. Checked on torch 2.13 against ZeroOptimizer (tests/test_zero_fp16.py), it
lacks three things, which this subclass adds and nothing else:

1. Stage 1 (and stage 2/3 after no_sync) reduce-scatters in opt.step(): at unscale_ the
   master shards have no gradient yet, so ShardedGradScaler found no inf and opt.step() then
   stepped the *scaled* gradient. unscale_ first finishes the reduction
   (ZeroOptimizer.reduce_gradients).
2. A lossy compressor's error-feedback memory: an overflowing step wrote NaN/Inf into it (and
   the finite ranks a residual of a gradient never applied), poisoning every later step. The
   scaler turns on the memory's staging (ZeroModel.stage_feedback) for the optimizers given
   at construction, from their first step; ZeroOptimizer.step() keeps a step's updates, a
   skipped step (scaler.step without opt.step) drops them: the memory is as before the step,
   as DataParallel's check_finite="skip" leaves it (pyfast.comm.guard).
3. A sparse compressor (topk, randomk) refuses NaN/Inf in the reduce-scatter
   (NonFiniteGradient on every rank: the run ends at its first overflow). Under staging such
   a unit is checked before it is sent and, if not finite, sent as zeros without memory; this
   rank's flag joins found_inf (ZeroModel.sent_nonfinite) before the all-reduce.

agree=False leaves found_inf this rank's own: the caller agrees it over the ranks before
step() (pyfast train folds it into the step's one all-reduce, Job.train_step). A ZeroOptimizer
with error feedback that was not given at construction is refused at unscale_ (its first step
could not be rolled back).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from .optimizer import ZeroOptimizer


class ZeroGradScaler(ShardedGradScaler):
    """ShardedGradScaler's arguments (device, init_scale, growth/backoff, process_group: the
    group found_inf is all-reduced over -- the whole mesh, dp x tp x pp, so every rank skips
    together), plus optimizer (a ZeroOptimizer or a list of them: their feedback memory staged
    from the first step) and agree (False: no all-reduce; see the module docstring)."""

    def __init__(self, device: str = "cuda", *, optimizer=None, agree: bool = True,
                 process_group=dist.group.WORLD, **kwargs):
        super().__init__(device, process_group=process_group, **kwargs)
        opts = [] if optimizer is None else \
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        for o in opts:
            if not isinstance(o, ZeroOptimizer):
                raise TypeError(f"ZeroGradScaler(optimizer=): ZeroOptimizers (zero()'s), got "
                                f"{type(o).__name__}")
            if self._enabled:
                o.model.stage_feedback(True)
        self.agree = agree

    @staticmethod
    def _check(optimizer) -> None:
        m = optimizer.model
        if getattr(m.compressor, "feedback", None) is not None and not m._staging:
            raise ValueError(
                f"ZeroGradScaler: this ZeroOptimizer's gradient compressor {m.compressor.spec!r} "
                "has error feedback, whose memory a skipped (overflowing) step must put back; "
                "pass the optimizer at construction, ZeroGradScaler(device, optimizer=opt), so "
                "it is staged from the first step")

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        if isinstance(optimizer, ZeroOptimizer):
            self._check(optimizer)
            optimizer.reduce_gradients()  # stage 1: the master shards get their .grad here
        flags = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if isinstance(optimizer, ZeroOptimizer) and optimizer.model.sent_nonfinite:
            next(iter(flags.values())).fill_(1.0)  # before the all-reduce: every rank skips
        return flags

    def unscale_(self, optimizer) -> None:
        if self.agree:
            return super().unscale_(optimizer)
        # torch.amp.GradScaler's unscale_ (the same state and checks) runs the override above
        return torch.amp.GradScaler.unscale_(self, optimizer)

    def found_inf(self, optimizer) -> torch.Tensor:
        """This step's found_inf (after unscale_): > 0 if the step is skipped; with agree=False
        this rank's own, for the caller to agree on (and to set, if other ranks found one)."""
        flags = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if not flags:
            raise RuntimeError("ZeroGradScaler.found_inf: call unscale_(optimizer) first")
        total = flags[0]
        for f in flags[1:]:  # parameters on several devices: one flag each
            total = total + f.to(total.device)
        return total

    def step(self, optimizer, *args, **kwargs):
        out = super().step(optimizer, *args, **kwargs)
        if self._enabled and isinstance(optimizer, ZeroOptimizer):
            # opt.step() kept the step's feedback updates; a skipped step drops them (GradScaler
            # read found_inf on the host just now: this read adds no wait)
            if self.found_inf(optimizer).item() > 0:
                optimizer.model.settle_feedback(False)
        return out
