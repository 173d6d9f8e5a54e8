"""Peak memory of a step by storage accounting: a TorchDispatchMode sees every op, counts the
bytes of each storage an op creates while it is alive, and keeps the largest total. Works alike
on meta tensors (the dry run: shapes, no data) and on real ones, so a dry run can be checked
against the same step on CPU tensors.

What a live storage is, at the peak (by identity when the step ends; else where it was made):
parameters (and module buffers, and ZeRO's master shards), gradients (.grad), optimizer
(optimizer state; temporaries made inside torch.optim), feedback (error-feedback memory of
pyfast.compress.feedback), comm_buffers (made inside pyfast.comm, torch.distributed or the
pipeline's / tensor parallelism's p2p, and the buffers the parallel wrappers keep between steps:
gradient buckets, flat shards), activations (everything else made during the step: what forward
saves for backward, and temporaries).

Host memory (zero(offload=...)) is counted apart: a storage registered as host by
pyfast.parallel.zero.offload (the master shards, their gradients, the inner optimizer's state),
or made inside Host.empty or the host step (offload_step.host_step: the optimizer's
temporaries), adds to `host_bytes` (its own peak) and not to the device's `peak_bytes`.
"""
from __future__ import annotations

import sys
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KINDS = ("parameters", "gradients", "optimizer", "activations", "comm_buffers", "feedback")
# frames whose files make a buffer a communication buffer (path fragments)
COMM_FILES = ("/pyfast/comm/", "/pyfast/parallel/p2p.py", "/pyfast/parallel/tp_comm.py",
              "/torch/distributed/")
OPT_FILES = ("/torch/optim/", "/pyfast/parallel/zero/optimizer.py")
# (file, function) whose ops make host memory, wherever they are on the stack (module docstring)
HOST_FRAMES = {("/pyfast/parallel/zero/offload.py", "empty"),
               ("/pyfast/parallel/zero/offload_step.py", "host_step")}


def _where() -> str:
    """'host' inside HOST_FRAMES; else 'comm_buffers' or 'optimizer' when an op runs inside
    such code (the innermost wins), else 'activations'."""
    f, kind = sys._getframe(2), None
    while f is not None:
        name = f.f_code.co_filename
        if any(name.endswith(h) and f.f_code.co_name == c for h, c in HOST_FRAMES):
            return "host"
        if kind is None and any(k in name for k in COMM_FILES):
            kind = "comm_buffers"
        if kind is None and any(k in name for k in OPT_FILES):
            kind = "optimizer"
        f = f.f_back
    return kind or "activations"


def _is_host(s) -> bool:
    from pyfast.parallel.zero.offload import is_host
    return is_host(s)


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse / wrapper tensors: no plain storage
        return None


class MemoryTracker(TorchDispatchMode):
    """Live bytes by storage; `peak` and the live storages at the peak. seed() the tensors that
    exist before the step (parameters, optimizer state, ...) so they count from the start."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.bytes = self.peak = 0
        self.host_bytes = self.host_peak = 0  # kind "host": offload's, not the device's
        self.at_peak: list[tuple[StorageWeakRef, int, str]] = []
        self.lock = threading.Lock()  # pyfast.comm's worker thread runs ops under this mode too

    def _add(self, t: torch.Tensor, kind: str) -> None:
        s = _storage(t)
        if s is None:
            return
        key = s._cdata
        old = self.live.get(key)
        if old is not None:
            if not old[0].expired():
                return
            self._count(old[2], -old[1])  # freed, and its address reused by this new storage
        if kind != "host" and _is_host(s):
            kind = "host"
        n = s.nbytes()
        self.live[key] = (StorageWeakRef(s), n, kind)
        self._count(kind, n)

    def _count(self, kind: str, n: int) -> None:
        if kind == "host":
            self.host_bytes += n
        else:
            self.bytes += n

    def seed(self, tensors) -> None:
        """What exists before the step; unless breakdown() names it (parameters, gradients,
        optimizer state, feedback), it is a buffer a parallel wrapper keeps between steps
        (gradient buckets, flat shards, side bands): comm_buffers; host if offload's (_add)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t, "comm_buffers")
        self._sweep()

    def _sweep(self) -> None:
        if self.bytes <= self.peak and self.host_bytes <= self.host_peak:
            return  # counting the freed too, no new peak: no need to look
        dead = [k for k, (ref, _, _) in self.live.items() if ref.expired()]
        for k in dead:
            _, n, kind = self.live.pop(k)
            self._count(kind, -n)
        if self.bytes > self.peak:
            self.peak = self.bytes
            self.at_peak = [x for x in self.live.values() if x[2] != "host"]
        self.host_peak = max(self.host_peak, self.host_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        with self.lock:
            self._account(new)
        return out

    def _account(self, new) -> None:
        kind = None
        for t in new:  # a view of a live storage adds nothing; only a new storage can raise the peak
            s = _storage(t)
            if s is None:
                continue
            old = self.live.get(s._cdata)
            if old is None or old[0].expired():
                kind = kind or _where()
                self._add(t, kind)
        if kind is not None:
            self._sweep()

    def breakdown(self, params, grads, optimizer, feedback) -> dict:
        """{"peak_bytes", kind: bytes, ..., "host_bytes"}: the device's live storages at its
        peak, and the host's peak (offload); the identity sets
        (tensors alive now) name parameters, gradients, optimizer state and feedback memory."""
        ident = {}
        for kind, ts in (("feedback", feedback), ("optimizer", optimizer),
                         ("gradients", grads), ("parameters", params)):
            for t in ts:
                s = _storage(t)
                if s is not None:
                    ident[s._cdata] = kind
        out = dict.fromkeys(KINDS, 0)
        for ref, n, kind in self.at_peak:
            if not ref.expired():
                kind = ident.get(ref.cdata, kind)
            out[kind] += n
        return {"peak_bytes": self.peak, **out, "host_bytes": self.host_peak}


def held(root, skip=()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every tensor `root` holds, its error-feedback memory), searched through pyfast objects,
    modules, optimizers and containers; attributes named in `skip` are left out."""
    from pyfast.compress.feedback import ErrorFeedback
    tensors, feedback, seen, todo = [], [], set(), [root]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            tensors.append(o)
            if o.grad is not None:
                tensors.append(o.grad)
        elif isinstance(o, ErrorFeedback):
            # a staged step's (fp16: comm.guard, zero's scaler) spare and new memories too
            feedback += [*o.memory.values(), *o._spare.values(), *(o._staged or {}).values()]
        elif isinstance(o, dict):
            todo += list(o.values())
        elif isinstance(o, (list, tuple, set)):
            todo += list(o)
        elif hasattr(o, "__dict__") and (isinstance(o, (torch.nn.Module, torch.optim.Optimizer))
                                         or type(o).__module__.startswith("pyfast")):
            todo += [v for k, v in vars(o).items() if k not in skip]
    return tensors + feedback, feedback


def optimizer_tensors(opt) -> list[torch.Tensor]:
    return [t for st in opt.state.values() for t in tree_leaves(st) if isinstance(t, torch.Tensor)]
