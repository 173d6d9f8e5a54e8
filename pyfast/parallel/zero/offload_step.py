"""zero(offload="optimizer"): this rank's fp32 master shards, their gradients and the optimizer
state in host memory, the inner optimizer stepping there (ZeRO-Offload; FSDP2's
CPUOffloadPolicy keeps the same three on the host). The primitives (host buffers, copies, the
memory check) are offload.py's; this file is what ZeroModel / ZeroOptimizer do with them.

Per unit (layout.Unit) the host holds one segment of S fp32 (pinned on CUDA) whose shard views
are the master shards (so a unit moves in ONE copy each way, padding included, zeros as on the
device), and one gradient segment of S fp32 (two with delay=True: the step in flight reads one
while backward fills the other):
- gradients, device -> host: each unit's reduce-scatter output (compressed or not, after the
  hybrid replica all-reduce) is copied into the gradient segment: started during backward for
  every unit whose reduce-scatter has completed by the time a later unit is launched (early(),
  polled at each launch), the rest in ZeroModel._finish; on CUDA on offload's d2h stream, on
  CPU a copy either way. The device output is then dropped: no gradient shard stays there.
- the step: the inner optimizer on the host masters (torch's AdamW runs its foreach kernels on
  CPU tensors; pyfast.optim.AdamW's C++ kernel where it is the optim_cls).
- parameters, host -> device: stages 1/2 all-gather a device segment made by one H2D copy of
  the host segment (ZeroModel._start_gather); stage 3 keeps a DEVICE copy of each unit's
  segment (fp32, `device_shard(u)`) as the gather source, refreshed from the host right after
  the step (`refresh_device_shards()`; on CUDA on the h2d stream in forward order, each gather
  waiting for its own unit's copy only: the rest overlap the next forward's first units).
- delay=True (ZeRO-Offload's one-step delayed parameter update): step N hands gradient N to a
  worker thread and installs the masters that the worker's previous step (gradient N-1) left:
  the host step runs while the device does step N+1's forward and backward (torch releases the
  GIL inside its ops). The first step only stores its gradient. The pending gradient is never
  on a master's .grad (the worker owns those), so norm and clip read `grads()` instead.

Host bytes per rank (check before allocating, offload.Host.check): 4 S (master) + 4 S per
gradient segment + the optimizer state: 8 S for the Adam family (two fp32 moments), 4 S for
the other PER_ELEMENT optimizers (one buffer: SGD's momentum, Adagrad's sum, RMSprop's square
average; an over-count for plain SGD, an under-count for RMSprop(centered) / ASGD / Rprop, which
keep two), S summed over units (padding included: it is allocated).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .offload import OffloadError

ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


def state_floats(optim_cls) -> int:
    """fp32 state elements per parameter element the inner optimizer keeps (module docstring)."""
    names = {c.__name__ for c in getattr(optim_cls, "__mro__", ())}
    return 2 if names & set(ADAM_LIKE) else 1


def host_bytes(layout, optim_cls, delay: bool) -> int:
    """The host memory this rank's offloaded shards need (module docstring)."""
    s = sum(u.S for u in layout.units)
    return 4 * s * (1 + (2 if delay else 1) + state_floats(optim_cls))


class HostShards:
    """The host side of one ZeroModel (module docstring). `masters[u][i]` are host views."""

    def __init__(self, model, off):
        self.model, self.off, self.host = model, off, off.host
        units, dev = model.layout.units, model._device
        self.segs = [self.host.empty(u.S) for u in units]
        self.gsegs = [[self.host.empty(u.S) for u in units] for _ in range(2 if off.delay else 1)]
        self.buf = 0  # which gradient segment backward fills (delay: alternates per step)
        self._early: dict = {}  # unit index -> (dst, fresh, Copy) started during backward
        for seg in self.segs + [g for gs in self.gsegs for g in gs]:
            seg.zero_()  # the padding between shards travels with them: zeros, as on the device
        self.masters = []
        for u, seg in zip(units, self.segs):
            ms = []
            for i, p in enumerate(u.params):
                sh = u.shards[i]
                m = u.shard_view(seg, i)
                m.copy_(p.detach().reshape(-1)[sh.start:sh.start + sh.length])
                ms.append(m)
            self.masters.append(ms)
        # stage 3's gather source on the device (offload="optimizer"; "params" has none)
        self.dsegs = None
        self._h2d: dict = {}  # stage 3: unit index -> its refresh copy, waited at its gather
        if model.stage == 3 and off.mode == "optimizer":
            self.dsegs = [torch.zeros(u.S, dtype=torch.float32, device=dev) for u in units]
            self.refresh()
        # delay=True: the gradient each master steps with next, and the worker's step in flight
        self.pending = [[None] * len(u.params) for u in units] if off.delay else None
        self._pool = ThreadPoolExecutor(1, "pyfast-offload") if off.delay else None
        self._future = None
        self._done = False  # delay=True: a step finished since the last wait()
        self._registered = 0

    # ------------------------------------------------------------------ gradients in
    def _start(self, u, out):
        """Start unit u's device -> host copy: (dst, fresh, Copy). Into its gradient segment
        when none of its shards holds a gradient yet, else a temporary (added in grads_in)."""
        fresh = all(g is None for g in self._grads_of(u))
        dst = self.gsegs[self.buf][u.index] if fresh else self.host.empty(u.S)
        return dst, fresh, self.host.to_host(dst, out)

    def early(self, inflight) -> None:
        """During backward (ZeroModel._launch, as each unit is launched): start the copy of
        every earlier unit whose reduce-scatter has completed, so on CUDA the copies run beside
        the rest of backward instead of after it (polled at launches: no callback thread)."""
        for u, out, h in inflight:
            if u.index in self._early or not (h is None or h.is_completed()):
                continue
            try:
                if h is not None:
                    h.wait()  # done: returns at once (orders the current stream after it)
            except BaseException:  # noqa: BLE001 -- finish()'s wait_then_raise raises it
                continue
            self._early[u.index] = self._start(u, out)

    def grads_in(self, inflight, used) -> None:
        """Copy each reduced unit (u, out) into its host gradient segment (or take the copy
        early() started); used(u, i) says which parameters have a gradient (the side band).
        Accumulates where a shard already has one (several synced backwards)."""
        gsegs = self.gsegs[self.buf]
        early, self._early = self._early, {}
        copies = [(u, *(early.get(u.index) or self._start(u, out))) for u, out, _ in inflight]
        for u, dst, fresh, c in copies:
            c.wait()
            have = self._grads_of(u)
            for i in range(len(u.params)):
                if not used(u.index, i):
                    continue
                g = u.shard_view(dst, i)
                if have[i] is None:
                    if not fresh:  # a parameter first used in a later backward
                        g = u.shard_view(gsegs[u.index], i).copy_(g)
                    self._set_grad(u, i, g)
                else:
                    have[i].add_(g)

    def _grads_of(self, u) -> list:
        if self.pending is not None:
            return list(self.pending[u.index])
        return [m.grad for m in self.masters[u.index]]

    def _set_grad(self, u, i, g) -> None:
        if self.pending is not None:
            self.pending[u.index][i] = g
        else:
            self.masters[u.index][i].grad = g

    def grads(self) -> list[list]:
        """Per unit and parameter: the gradient shard the next step applies (None: unused)."""
        return [self._grads_of(u) for u in self.model.layout.units]

    def clear_grads(self, set_to_none: bool) -> None:
        """zero_grad for the pending gradients (delay=True; the masters' .grad are the
        worker's)."""
        for gs in self.pending or []:
            for i, g in enumerate(gs):
                if set_to_none:
                    gs[i] = None
                elif g is not None:
                    g.zero_()

    # ------------------------------------------------------------------ parameters out
    def device_segment(self, u) -> torch.Tensor:
        """The device segment unit u's all-gather sends: stage 3's kept copy, or (stages 1/2)
        a fresh one made by one host -> device copy."""
        if self.dsegs is not None:
            c = self._h2d.pop(u.index, None)
            if c is not None:
                c.wait()  # its refresh copy (and those issued before it), not the later ones
            return self.dsegs[u.index]
        seg = torch.empty(u.S, dtype=torch.float32, device=self.model._device)
        self.host.to_device(seg, self.segs[u.index]).wait()
        return seg

    def refresh(self) -> None:
        """Stage 3: every unit's device segment from the host masters, issued in the order the
        next forward gathers them (the root, the last unit, first; then the wrapped modules in
        registration order, the reverse of unit order) on one side stream; each gather waits
        for its own unit's copy only (device_segment), so on CUDA the later copies run beside
        the next forward's first units."""
        if self.dsegs is None:
            return
        for i in reversed(range(len(self.dsegs))):
            self._h2d[i] = self.host.to_device(self.dsegs[i], self.segs[i])

    # ------------------------------------------------------------------ the step
    def step(self, inner, install) -> None:
        """Run the inner optimizer's step on the host masters, then install() them (the device
        parameters from the masters). delay=True: install the step the worker finished (if
        any) BEFORE the next one starts writing the masters, then hand it this gradient."""
        self.host.settle_h2d()  # CUDA: the last install's copies have read the masters
        if self.pending is None:
            host_step(inner)
            self._register(inner)
            install()
            return
        grads = self.grads()
        if self.wait():
            install()
            self.host.settle_h2d()  # before the worker writes the masters they copy
        self.buf = (self.buf + 1) % len(self.gsegs)  # the next backward fills the other one
        self.pending = [[None] * len(gs) for gs in grads]
        job = (inner, grads)
        if self.host.dry:  # meta: no thread (the dry run's tracker sees this thread's ops)
            self._delayed(*job)
        else:
            self._future = self._pool.submit(self._delayed, *job)

    def _delayed(self, inner, grads) -> bool:
        for ms, gs in zip(self.masters, grads):
            for m, g in zip(ms, gs):
                m.grad = g
        try:
            host_step(inner)
        finally:
            for ms in self.masters:
                for m in ms:
                    m.grad = None
        self._register(inner)
        self._done = True
        return True

    def wait(self) -> bool:
        """delay=True: finish the step in flight (its exception raised here); whether a step
        finished since the last wait (the masters changed)."""
        self.join()
        done, self._done = self._done, False
        return done

    def join(self) -> None:
        """delay=True: let the step in flight finish (a checkpoint reads the masters and state
        then) without installing it: the next step() does, as it would have."""
        f, self._future = self._future, None
        if f is not None:
            f.result()

    def _register(self, inner) -> None:
        """The inner optimizer's state is host memory too (the dry run counts it there)."""
        st = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        if len(st) != self._registered:
            self.host.register(*st)
            self._registered = len(st)

    def close(self) -> None:
        if self._pool is not None:
            try:
                self.wait()
            finally:
                self._pool.shutdown(wait=True)
                self._pool = None


def host_step(inner) -> None:
    """The inner optimizer's step on the host: its own file, so the dry run's tracker files
    what it makes (temporaries, state) as host memory (pyfast.train.memory.HOST_FILES)."""
    inner.step()


def check(layout, off, optim_cls) -> OffloadError | None:
    """This rank's host memory problem, if any (zero() agrees on it over the group)."""
    try:
        off.host.check(host_bytes(layout, optim_cls, off.delay),
                       f"offload={off.mode!r} ({state_floats(optim_cls)} state buffer(s) "
                       f"per element for {getattr(optim_cls, '__name__', optim_cls)})")
    except OffloadError as e:
        return e
    return None
