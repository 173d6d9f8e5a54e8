"""Data parallelism: DataParallel, a drop-in for torch's DistributedDataParallel that reduces
gradients through a compressor, bucket by bucket, while backward is still running.

DataParallelNaive beside it reduces every gradient after backward, one all_reduce each: it is
the oracle in tests and the floor in benchmarks.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist
from torch import nn

import pyfast.compress as C
from pyfast.comm import NonFiniteGradient, all_reduce
from pyfast.comm.collectives import wait_all
from pyfast.comm.auto import AutoSelector
from pyfast.comm.buckets import Bucketer


def check_same_layout(params: list[tuple[str, torch.Tensor]], group) -> None:
    """Raise on every rank, naming ranks and tensor, if parameter names/shapes/dtypes differ
    (instead of hanging in a collective of mismatched sizes). One small all_gather."""
    lines = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in params]
    digest = hashlib.sha256("\n".join(lines).encode()).digest()[:8]
    mine = torch.tensor([len(lines), int.from_bytes(digest, "little", signed=True)])
    world = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    bad = [r for r, t in enumerate(every) if not torch.equal(t, every[0])]
    if bad:
        obj = [None] * world
        dist.all_gather_object(obj, lines, group=group)
        first = next(i for i, (a, b) in enumerate(zip(obj[0], obj[bad[0]] + [None] * len(obj[0])))
                     if a != b)
        raise ValueError(f"parameters differ across ranks: rank 0 has {len(obj[0])} tensors, "
                         f"rank {bad[0]} has {len(obj[bad[0]])}; first difference at #{first}: "
                         f"rank 0 {obj[0][first] if first < len(obj[0]) else None!r} vs rank "
                         f"{bad[0]} {obj[bad[0]][first] if first < len(obj[bad[0]]) else None!r}")


def broadcast_state(module: nn.Module, group) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src, group=group)


class DataParallel(nn.Module):
    """DistributedDataParallel's job with a compressor.

    state_dict() keys are the wrapped module's with a "module." prefix, exactly as DDP's, so
    checkpoints move between the two. The compression state (error-feedback memory per
    bucket, compressor state such as PowerSGD's Q or shared-seed step counters) is not a
    module state: save it with compression_state_dict() and restore it with
    load_compression_state_dict() (DDP's comm hooks have no equivalent).
    """

    def __init__(self, module: nn.Module, compressor=None, bucket_mb: float = 25, group=None,
                 error_feedback: bool = True, overlap: bool = True, check_finite: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialized "
                               "(torchrun + dist.init_process_group)")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module, self.group, self.overlap = module, group, overlap
        self.check_finite = check_finite
        self.world = dist.get_world_size(group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        check_same_layout(named, group)
        broadcast_state(module, group)
        self.auto = compressor == "auto"
        base = C.get("fp16" if self.auto else compressor)
        lossy = base.spec not in ("none", "fp16", "bf16")
        self.compressor = C.WithFeedback(base) if error_feedback and lossy else base
        self.bucketer = Bucketer(named, bucket_mb, self._launch, enabled=overlap)
        self.selector = (AutoSelector(self.bucketer.buckets, group, error_feedback)
                         if self.auto else None)
        self._sync = True

    # ------------------------------------------------------------------ reduction
    def _launch(self, bucket) -> None:
        """Called by the bucketer when a bucket's gradients are all ready (in bucket order)."""
        c = self.selector.compressor(bucket) if self.selector else self.compressor
        if isinstance(getattr(c, "inner", c), C.PowerSGD):
            # low rank needs the matrices: reduce each parameter's view of the bucket
            handles = [all_reduce(bucket.flat[o: o + p.numel()].view(p.shape), c, self.group,
                                  op="avg", async_op=True, name=f"{bucket.name}.{n}")
                       for p, n, o in zip(bucket.params, bucket.names, bucket.offsets)]
            bucket.handle = _All(handles)
            return
        bucket.handle = all_reduce(bucket.flat, c, self.group, op="avg", async_op=True,
                                   name=bucket.name)

    def _finish(self) -> None:
        done = self.bucketer.finish()
        if self.selector is not None and len(done) == len(self.bucketer.buckets):
            self.selector.after_step([b.extra["seconds"] for b in done])
        for b in done:
            if self.check_finite and not torch.isfinite(b.flat).all():
                # the reduced bucket is bit-identical on every rank: so is this decision
                raise NonFiniteGradient(f"NaN/Inf in the reduced gradient of {b.name} "
                                        f"({', '.join(b.names[:3])}{'...' if len(b.names) > 3 else ''})")

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self._sync:
            self.bucketer.arm(self._finish)
        else:
            self.bucketer.disarm()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ state
    def compression_state_dict(self) -> dict:
        if self.selector is not None:
            sel = self.selector
            return {"spec": "auto", "choice": list(sel.choice), "fixed": sel.fixed,
                    "step": sel.step, "t16": list(sel.t16),
                    "state": {s: c.state_dict() for s, c in sel.made.items()}}
        return {"spec": self.compressor.spec, "state": self.compressor.state_dict()}

    def load_compression_state_dict(self, state: dict) -> None:
        mine = "auto" if self.selector is not None else self.compressor.spec
        if state.get("spec") != mine:
            raise ValueError(f"compression state is for {state.get('spec')!r}, this DataParallel "
                             f"uses {mine!r}")
        if self.selector is None:
            self.compressor.load_state_dict(state["state"])
            return
        sel = self.selector
        if len(state["choice"]) != len(sel.choice):
            raise ValueError(f"compression state has {len(state['choice'])} buckets, this "
                             f"DataParallel has {len(sel.choice)} (another bucket_mb or model?)")
        sel.choice, sel.fixed, sel.step, sel.t16 = (list(state["choice"]), state["fixed"],
                                                   state["step"], list(state["t16"]))
        for s, st in state["state"].items():
            sel.made[s].load_state_dict(st)


class _All:
    def __init__(self, handles):
        self.handles = handles

    def wait(self):
        wait_all(self.handles)


class DataParallelNaive(nn.Module):
    """After backward, all_reduce every gradient (fp32, average), one call each: the oracle."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, group
        broadcast_state(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def reduce_gradients(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= dist.get_world_size(self.group)
