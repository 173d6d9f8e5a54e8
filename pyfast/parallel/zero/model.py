"""ZeroModel: the wrapped module of pyfast.parallel.zero, and the gradient reduction of stages
1 and 2 (stage 3's gathers are in stage3.py).

Gradients are averaged by a reduce-scatter of each unit's buffer (pyfast.parallel.zero.layout):
rank r receives the average of its shards, the fp32 .grad of its master shards. Every rank
launches the units in unit order (strictly: pyfast.comm.ready, DataParallel's bucket engine too),
so the collectives pair up whatever order backward finishes gradients in.

- stage 1: backward leaves full gradients in param.grad (no hook, no communication); step()
  reduce-scatters every unit, then frees param.grad.
- stage 2: a post-accumulate-grad hook counts each unit's gradients; the moment a unit is
  complete (and every earlier one launched) its gradients are copied into a fresh buffer, the
  full param.grad freed, and an asynchronous reduce-scatter launched (on the native engine's
  thread, or comm.reduce_scatter on all_reduce's FIFO worker) while backward goes on. An
  autograd final callback launches what is left (unused parameters: zeros) and waits, so when
  loss.backward() returns the master shards hold their gradients, as after a DDP backward.

Unused parameters, as DataParallel (DDP with find_unused_parameters=True): a parameter no rank
produced a gradient for keeps a None master gradient, so the inner optimizer skips it (AdamW
then does not decay it, exactly as one process or DataParallel); one used on some ranks only is
averaged with zeros from the others. Which were used travels in a side band: one exact fp32
all-reduce of one flag per parameter after the units.

Engines (zero(engine=...)): the reduce-scatters (with the side band behind them) and the
parameter all-gathers run on a private pyfast.comm.engine.NativeEngine (C++ thread, no GIL,
its own process group made at construction, destroyed by close()) where the compressor is one
the engine codes (none, fp16, bf16, int8, int4, fp8, sign), else through comm.reduce_scatter /
comm.all_gather on comm's Python FIFO worker over `group`. Both are bitwise equal (same bytes,
same decode order, the error-feedback memory under the same names: u.name + ".i"), so the
engine never changes a result or a checkpoint; `engine_kind` says which runs each collective.

Sample weights (zero(samples=n), `model.samples = n`): ranks with different batch sizes, each
loss a mean over its own n samples; each unit's packed gradients are multiplied by n * W / N
(W: the ranks averaged over, shard group x replica group under hybrid sharding; N: the sum of
n over them, from one W-float all-reduce started at the forward, on the reduce-scatters' path
and then across the replicas) before the reduce-scatter, which stays an average: the master
shards get the gradient of the concatenated batch (pyfast.comm.weights; a rank with n < 1
raises ValueError on every rank after the step's reductions). Shards stay even (every rank
holds 1/W of every unit): only the batch is uneven. Not under torchft (FTError).

Buffers: at every forward with autograd on (outside no_sync), group rank 0's buffers are
broadcast to the others first, as DDP's broadcast_buffers=True and DataParallel.

A failed collective (a dead peer, the group's timeout) raises CommError naming the operation and
breaks the model (pyfast.comm.failure.Breaker, as DataParallel): every later forward and step
raises, since the ranks may be a collective apart. Bad input (ValueError/TypeError, raised the
same way on every rank) does not break it.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

import pyfast.compress as C
from pyfast._ranges import ranged
from pyfast.comm import all_gather, all_reduce, reduce_scatter
from pyfast.comm.collectives import Handle, all_finite
from pyfast.comm.buckets import broadcast_coalesced
from pyfast.comm.failure import Breaker
from pyfast.comm.ready import Readiness, SideBand, check_unchanged, wait_then_raise
from pyfast.comm.weights import SampleWeights
from pyfast.parallel.samples import Samples

from .meshes import is_pipeline


class ZeroModel(Samples, nn.Module):
    """The module handed back by pyfast.parallel.zero(): forward runs the wrapped module;
    state_dict() keys carry DDP's "module." prefix (as DataParallel's). no_sync() accumulates
    gradients locally (full .grad) until the next synced backward, as DDP's."""

    def __init__(self, module: nn.Module, layout, stage: int, compressor, group, named,
                 engine_kind=None, offload=None):
        super().__init__()
        self.offload = offload  # offload.Offload or None: zero(offload=...)
        # {"reduce_scatter": "native"|"python", "all_gather": ...}: who runs each collective
        self.engine_kind = dict(engine_kind or {"reduce_scatter": "python",
                                                "all_gather": "python"})
        self._engine = None
        if "native" in self.engine_kind.values():  # collective: a process group of its own
            from pyfast.comm.engine import NativeEngine
            self._engine = NativeEngine.private(group)
        self.module, self.layout, self.stage = module, layout, stage
        self.pipeline = is_pipeline(module)  # its forwards never pass through ours
        self.compressor, self.group = compressor, group
        self.world, self.rank = layout.world, layout.rank
        self._named, self._params = named, [p for _, p in named]
        self._names = {id(p): n for n, p in named}
        self._ids = {id(p) for p in self._params}
        # Per unit, per parameter: this rank's fp32 master shard. Stages 1/2 with an fp32
        # parameter: a view of the parameter itself (its elements [start, start+length) are
        # contiguous in the flat view), so no fp32 copy is kept twice: 4 psi + 12 psi / N. A
        # 16-bit parameter (and every parameter under stage 3, whose data is freed) gets its own.
        # With zero(offload=...): host views of one host segment per unit (offload_step.py).
        self.masters: list[list[torch.Tensor]] = []
        self._host = None  # offload_step.HostShards
        with torch.no_grad():
            if offload is not None:
                self._host = _host_shards(self, offload, group)
                self.masters = self._host.masters
            for u in layout.units if offload is None else []:
                self.masters.append([self._master(p, sh) for p, sh in zip(u.params, u.shards)])
        self.replicas = None  # hybrid sharding (hybrid.Replicas), set by zero()
        self._weights = SampleWeights("zero", self.world, self.rank, self._device)
        self._breaker = Breaker("this zero model")
        self.set_mesh(None, None, [False] * len(named))
        self._sync = True
        self._dirty = False  # a forward under no_sync since the last reduction (same on all ranks)
        # which parameters each rank used: one flag per parameter, unit by unit
        self._band = SideBand([len(u.params) for u in layout.units], 0, self._device)
        self._inflight: list = []  # (unit, out, handle)
        self._hooks = []  # stage 3's module hooks
        # fp16 loss scaling (scaler.py): the gradient compressor's feedback memory staged per
        # step, committed by the step, rolled back by a skipped one; a non-finite unit that a
        # compressor could drop (topk/randomk) sent as zeros without memory and flagged here
        self._staging = self._staged = False
        self._bad = False
        # stage 2/3: each unit's reduce-scatter launched (in unit order) as its gradients
        # complete, the rest and the wait in the autograd final callback
        self._ready = None if stage < 2 else Readiness(
            [u.params for u in layout.units], lambda i: self._launch(self.layout.units[i]),
            self._final, complete=self._complete)

    def _master(self, p, sh) -> torch.Tensor:
        piece = p.detach().reshape(-1)[sh.start:sh.start + sh.length]
        if self.stage < 3 and p.dtype == torch.float32 and p.is_contiguous():
            return piece
        return piece.to(torch.float32).clone()

    def set_mesh(self, tp_group, pp_group, tp_sharded: list) -> None:
        """zero(tp_group=, pp_group=) (meshes.py): the groups, and per unit and parameter whether
        it is a tensor-parallel shard (tp_sharded: per trainable parameter, in `named` order)."""
        self.tp_group, self.pp_group = tp_group, pp_group
        flags = {id(p): bool(f) for p, f in zip(self._params, tp_sharded)}
        self.tp_sharded = [[flags[id(p)] for p in u.params] for u in self.layout.units]

    # ------------------------------------------------------------------ samples (comm.weights)
    def init_samples(self, samples) -> None:
        """zero(samples=): the weights over every rank the gradient is averaged over (the
        replicas too, once zero() has set them)."""
        r = self.replicas
        if r is not None and not getattr(r, "torchft", False):
            self._weights = SampleWeights("zero", self.world * r.world,
                                          r.rank * self.world + self.rank, self._device)
        self.samples = samples  # pyfast.parallel.samples

    def _torchft(self) -> bool:
        return getattr(self.replicas, "torchft", False)

    def _issue(self, vec):
        """Sum the samples vector on the reduce-scatters' path, then across the replicas."""
        if self.engine_kind["reduce_scatter"] == "native":
            h = self._engine.all_reduce(vec, None, op="sum", name="samples")
        else:
            h = all_reduce(vec, None, self.group, op="sum", async_op=True, name="samples")
        if self.replicas is None:
            return h

        def across():
            h.wait()
            all_reduce(vec, None, self.replicas.group, op="sum")
        return Handle.on_worker(across)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        u, i = self.layout.of(p)
        return self.masters[u.index][i]

    def name_of(self, p: torch.Tensor) -> str:
        return self._names[id(p)]

    # ------------------------------------------------------------------ forward
    def _check_params(self) -> None:
        """The shards were laid out for these trainable parameters (comm.ready.check_unchanged)."""
        check_unchanged(self.module, self._named, "zero()")

    def forward(self, *args, **kwargs):
        self._breaker.check()
        self._check_params()
        if torch.is_grad_enabled() and not self._sync:
            self._dirty = True  # gradients accumulate outside a reduction: step() reduces them
        if torch.is_grad_enabled() and self._sync:
            bufs = list(self.module.buffers())
            if bufs:
                if self.replicas is not None:
                    self.replicas.broadcast(bufs)
                broadcast_coalesced(bufs, self.group)
            self._weights.start(self._issue)
            if self._ready is not None:
                self._ready.arm()
        elif self._ready is not None:
            self._ready.disarm()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally in param.grad (full size, as DDP); the first backward
        after the block reduces the sum. Stage 1 always accumulates until step()."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ stage 2
    @property
    def _armed(self) -> bool:
        """Whether the running backward launches units as they complete."""
        return self._ready is not None and self._ready.armed

    def _complete(self, i: int) -> None:
        """Unit i's last gradient arrived (stage 3 packs it here)."""

    def _final(self) -> None:
        """Autograd final callback, after the units left were launched: wait."""
        self._dirty = False
        self.finish()

    @ranged("pyfast.zero.reduce")
    def _launch(self, u) -> None:
        """Start unit u's reduce-scatter (its gradients packed now unless they already are)."""
        buf = u.extra.pop("packed", None)
        if buf is None:
            buf = self._pack(u)
        out = torch.empty(u.S, dtype=torch.float32, device=buf.device)
        c = self.compressor.base if u.extra.pop("base", False) else self.compressor
        if self.engine_kind["reduce_scatter"] == "native":  # waited for in finish()
            h = self._engine.reduce_scatter(out, buf, c, op="avg", name=u.name)
        else:
            h = reduce_scatter(out, buf, c, self.group, op="avg",
                               async_op=self.stage >= 2, name=u.name)
            h = h if self.stage >= 2 else None
        if self.replicas is not None:  # hybrid: the shard's all-reduce across the replicas
            h = self.replicas.launch(u, out, h, async_op=self.stage >= 2)
        self._inflight.append((u, out, h))
        if self._host is not None:  # offload: the finished units' copies to the host, now
            self._host.early(self._inflight)

    def _pack(self, u) -> torch.Tensor:
        """Unit u's gradients in a fresh buffer (zeros for None), the full .grad freed."""
        buf = u.new_buffer(self._device)
        self._band.mark_used(u.index, u.params)
        with torch.no_grad():
            for i, p in enumerate(u.params):
                u.copy_in(buf, i, p.grad)
                p.grad = None
            if self._weights.active:  # n * W / N (module docstring)
                buf.mul_(self._weight(None))
        if self._staging:
            self._guard(u, buf)
        return buf

    # ------------------------------------------------------------------ fp16 (scaler.py)
    def stage_feedback(self, on: bool = True) -> None:
        """Stage the gradient compressor's error-feedback memory step by step (on: what a loss
        scaler needs, pyfast.parallel.zero.scaler): the updates of a step's reductions are
        written beside the old memory (ErrorFeedback.begin_step: twice its memory, and a copy
        of each unit's memory a step, since the reduce-scatters update it in place) and kept
        by settle_feedback(True) -- ZeroOptimizer.step() -- or dropped by settle_feedback(False)
        (a skipped step), so an overflowing step leaves no NaN/Inf, and no residual of
        gradients never applied, in the memory. A no-op without error feedback."""
        self._staging = bool(on) and getattr(self.compressor, "feedback", None) is not None

    def _guard(self, u, buf) -> None:
        """Open the step's staging at its first unit. A quantizer or block codec carries a
        NaN/Inf to the shard's owner (a non-finite block decodes to NaN, pyfast.comm.guard);
        the sparse ones do not (topk/randomk's reduce-scatter raises NonFiniteGradient on
        every rank, which would end an fp16 run at its first overflow), so their units are
        checked here (one aminmax pass): a non-finite one is sent as zeros without the memory
        (u.extra["base"]) and flagged for the scaler."""
        if not self._staged:
            self.compressor.feedback.begin_step()
            self._staged, self._bad = True, False
        if not isinstance(self.compressor.base, (C.Quantizer, C.BlockCodec)) \
                and not all_finite(buf):
            buf.zero_()
            u.extra["base"] = True
            self._bad = True

    @property
    def sent_nonfinite(self) -> bool:
        """Whether this step this rank sent a non-finite unit as zeros (_guard): its shards'
        owners cannot see the overflow, so the scaler adds this flag to its found_inf."""
        return self._bad

    def settle_feedback(self, keep: bool) -> None:
        """Close the step's staging: keep (the step was applied) or drop the feedback updates."""
        self._bad = False
        if self._staged:
            fb = self.compressor.feedback
            fb.commit() if keep else fb.rollback()
            self._staged = False

    def _guarded(self, what: str):
        """A failure breaks the model; under torchft it is reported instead (hybrid.Quorum)."""
        r = self.replicas
        return r.reported() if getattr(r, "torchft", False) else self._breaker.guard(what)

    @property
    def _device(self):
        return self._params[0].device if self._params else None

    @ranged("pyfast.zero.wait")
    def finish(self) -> None:
        """Wait for every launched reduce-scatter (all of them, even after one failed: one
        still running would interleave with the caller's next collective), agree on which
        parameters were used (side band), and add each reduced shard to its master's .grad."""
        with self._guarded("zero gradient reduce-scatter"):
            self._finish()
        self._weights.check(self.group)  # a rank with n < 1: raised on every rank

    def _finish(self) -> None:
        inflight, self._inflight = self._inflight, []
        wait_then_raise([h for _, _, h in inflight])
        if not inflight:
            return
        # on the FIFO of the reduce-scatters (stage 3 may have a gather queued there too)
        native = self.engine_kind["reduce_scatter"] == "native"
        self._band.reduce(self._engine if native else None, self.group).wait()
        if self.replicas is not None:
            self.replicas.sum_flags(self._band.t)
        self._band.read(self.group)  # a dry run: all used
        self._band.begin()
        if self._host is not None:  # offload: into the host gradient segments, off the device
            self._host.grads_in(inflight, self._band.used)
            return
        for u, out, _ in inflight:
            for i, p in enumerate(u.params):
                if not self._band.used(u.index, i):
                    continue
                m = self.masters[u.index][i]
                g = u.shard_view(out, i)
                if m.grad is None:
                    m.grad = g
                else:
                    m.grad.add_(g)

    def reduce_gradients(self) -> None:
        """Reduce what the parameters' .grad hold now (stage 1 at step(); stage 2 after a
        backward under no_sync, or one that did not go through forward)."""
        self._dirty = False
        if self._ready is not None:
            self._ready.disarm()
        if not self._weights.active:  # no forward started it (a Pipeline, no_sync)
            self._weights.start(self._issue)
        with self._guarded("zero gradient reduce-scatter"):  # stage 1's run here
            for u in self.layout.units:
                self._launch(u)
        self.finish()

    # ------------------------------------------------------------------ step's other half
    @ranged("pyfast.zero.gather")
    def gather_params(self) -> None:
        """Stages 1/2: every rank's updated master shards into every rank's parameters, one
        exact all-gather per unit: bit-identical replicas (every rank copies the same bytes)."""
        self._breaker.check()
        with torch.no_grad(), self._breaker.guard("zero parameter all-gather"):
            # two units in flight: unit i+1 travels while unit i is copied into the parameters
            # (one full buffer more than one at a time, never all of them)
            prev = None
            for u in self.layout.units + [None]:
                cur = None if u is None else (u, *self._start_gather(u, None))
                if prev is not None:
                    pu, h, full = prev
                    h.wait()
                    for i, p in enumerate(pu.params):
                        pu.copy_out(full, i, p.data)
                prev = cur

    def _start_gather(self, u, compressor, seg=None):
        """Start the all-gather of unit u's master shards: (handle, the full buffer). seg: the
        device segment to send, made by the caller (stage 3 offload="params": staged ahead)."""
        if seg is not None:
            pass
        elif self._host is not None:  # offload: from the host segment (stage 3: its device copy)
            seg = self._host.device_segment(u)
        else:
            seg = torch.zeros(u.S, dtype=torch.float32, device=self._device)
            for i, m in enumerate(self.masters[u.index]):
                u.shard_view(seg, i).copy_(m)
        full = u.new_buffer(self._device)
        if self.engine_kind["all_gather"] == "native":
            return self._engine.all_gather(full, seg, compressor, name=u.name), full
        return all_gather(full, seg, compressor, self.group, async_op=True, name=u.name), full

    # ------------------------------------------------------------------ offload (offload_step)
    def device_shard(self, u) -> torch.Tensor:
        """zero(offload="optimizer"), stage 3: unit u's device copy of this rank's fp32 segment
        (its master shards at u.shard_view offsets), the source of its parameter all-gather."""
        if self._host is None or self._host.dsegs is None:
            raise RuntimeError("device_shard: only stage 3 with offload='optimizer' keeps one")
        return self._host.device_segment(u)  # (its refresh copy waited for)

    def refresh_device_shards(self) -> None:
        """Stage 3 with offload: the device shards from the host masters (after a step or a
        checkpoint load). A no-op otherwise."""
        if self._host is not None:
            self._host.refresh()

    def flush_offload(self) -> None:
        """delay=True: finish the host step in flight and install it now (a checkpoint then
        holds every gradient applied, and the run after it continues exactly as a resume from
        it does). Collective under stages 1/2 (the all-gather). A no-op otherwise."""
        if self._host is not None and self._host.wait():
            self.gather_params() if self.stage < 3 else self.refresh_device_shards()

    def close(self) -> None:
        """Remove the gradient hooks (the wrapped module stays usable on its own); wait for the
        collectives in flight, join the native engine's thread and destroy its process group.
        Call it before dist.destroy_process_group(). Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._ready is not None:
            self._ready.close()
        with contextlib.suppress(BaseException):  # a samples vector still in flight
            self._weights.drop()
        pending = [h for _, _, h in self._inflight if h is not None]
        pending += [h for h, _ in getattr(self, "_gathering", {}).values()]
        for h in pending:
            with contextlib.suppress(BaseException):  # already raised, or will not matter now
                h.wait()
        self._inflight = []
        if self._host is not None:
            self._host.close()
        if hasattr(self, "_gathering"):
            self._gathering.clear()
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def _host_shards(model, off, group):
    """The model's HostShards; a refused pinned allocation raises on every rank of the group."""
    from pyfast.comm.agree import agree
    from .offload import OffloadError
    from .offload_step import HostShards
    shards, problem = None, None
    try:
        shards = HostShards(model, off)
    except OffloadError as e:
        problem = e
    agree(None, problem, group, what="zero(offload=...)", device=model._device)
    return shards
