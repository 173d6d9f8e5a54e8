"""The bucket engine that DataParallel (pyfast.comm.buckets.Bucketer) and ZeRO stages 2/3
(pyfast.parallel.zero.model) share: readiness, in-order launch, the final callback, the side
band of used flags, wait-all-then-raise, and the check that the parameters did not change.

Readiness: a post-accumulate-grad hook per parameter counts each bucket's gradients (one
hook a parameter is the finest torch offers: autograd accumulates each leaf on its own). A
bucket is launched the moment it and every earlier one are complete, strictly in index order,
so every rank issues the same collectives in the same order whatever order backward finishes
gradients in. The first gradient of an armed backward queues the autograd final callback: it
launches what is left (buckets with a parameter no gradient reached: unused this step) and
hands over to the reducer's wait, so when loss.backward() returns every gradient is reduced,
as after a DDP backward.

Side band (DDP's find_unused_parameters map): which parameters this rank produced a gradient
for, plus a few flags of the reducer's own (DataParallel's per-bucket non-finite flags), summed
over the ranks by one exact fp32 all-reduce queued behind the buckets on the same FIFO. The
flags are kept in a Python list and written into the tensor once a step, right before that
all-reduce: one host-to-device copy instead of one indexed write per parameter (each ~5 us on
the CPU, a small synchronous copy each on CUDA); on CUDA from pinned memory, without a host sync
(a pageable copy_ synchronizes the stream). The sum is read back (a host sync on CUDA) only when
a caller needs an answer the rank's own flags do not give: a parameter this rank produced a
gradient for was used, whatever the others did, so a step in which every parameter got a
gradient here reads nothing (DataParallel with compressor none, fp16 or bf16 then syncs
nothing a step; issue 25).
"""
from __future__ import annotations

import weakref

import torch
from torch.nn.modules import module as torch_module

from pyfast.comm import all_reduce
from pyfast.comm.collectives import sum_async, wait_all
from pyfast.comm.dry import read


class Readiness:
    """Launch buckets in index order as their gradients complete (module docstring).

    groups: each bucket's parameters, in launch order. launch(i) starts bucket i; final()
    runs in the autograd final callback (or flush()) after every bucket was launched.
    complete(i), if given, runs when bucket i's last gradient arrives, before it may launch
    (stage 3 packs and frees a unit there). enabled=False: count, launch everything at the
    end (DataParallel's overlap=False)."""

    def __init__(self, groups: list, launch, final, enabled: bool = True, complete=None):
        self.launch_fn, self.final_fn, self.enabled = launch, final, enabled
        self.complete_fn = complete
        self.sizes = [len(g) for g in groups]
        self.where = {id(p): i for i, g in enumerate(groups) for p in g}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook)
                       for g in groups for p in g]
        self.armed = False
        self.pending = [0] * len(self.sizes)
        self.next = 0
        self._queued = False
        # a flush found a bucket short of gradients: a parameter went unused (or was frozen,
        # replaced, deleted); ParamWatch then walks the module at the next check
        self.incomplete = False

    def arm(self) -> None:
        """Launch the buckets of the next backward as they complete (called by forward)."""
        self.armed, self.next, self._queued = True, 0, False
        self.pending = list(self.sizes)

    def disarm(self) -> None:
        self.armed = False

    def close(self) -> None:
        """Remove the hooks: the parameters no longer reference the reducer."""
        self.armed = False
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._queued = True
        i = self.where[id(p)]
        self.pending[i] -= 1
        if self.pending[i] == 0:
            if self.complete_fn is not None:
                self.complete_fn(i)
            if self.enabled:
                self.launch_ready()

    def launch_ready(self) -> None:
        while self.next < len(self.sizes) and self.pending[self.next] == 0:
            self.launch_fn(self.next)
            self.next += 1

    def flush(self) -> None:
        """Launch every bucket not launched yet (gradients taken as they are), then final():
        the autograd final callback, and the reducers' reduce_gradients() after arm()."""
        self.armed = False
        self.incomplete = any(self.pending)
        self.pending = [0] * len(self.sizes)
        self.launch_ready()
        self.final_fn()


def wait_then_raise(handles) -> None:
    """Wait for every handle (None: nothing in flight), even after one failed, then raise the
    first error: a reduction still running on the communication thread would otherwise
    interleave with the caller's next collective, in a different order on each rank (seen as
    a 120 s gloo hang in tests)."""
    wait_all([h for h in handles if h is not None])


class SideBand:
    """One step's flags: `used` (one per parameter, bucket by bucket) then `extra` of the
    reducer's own, summed over the ranks by reduce() (module docstring)."""

    def __init__(self, sizes: list[int], extra: int, device=None):
        self.first = [0]  # bucket i's flags start at first[i]
        for n in sizes:
            self.first.append(self.first[-1] + n)
        self.n_used = self.first[-1]
        self.flags = [0.0] * (self.n_used + extra)
        self.t = torch.zeros(len(self.flags), device=device)
        self.own = self.flags  # the flags of the step read() stands for (this rank's)
        self.summed: list | None = None  # the sum over the ranks, once read
        self._group = None

    def begin(self) -> None:
        """A new step's flags (a fresh list: the last read() stays answerable)."""
        self.flags = [0.0] * len(self.flags)

    def mark_used(self, i: int, params) -> None:
        """Bucket i's parameters that hold a gradient on this rank now."""
        a = self.first[i]
        self.flags[a:a + len(params)] = [float(p.grad is not None) for p in params]

    def set_extra(self, j: int) -> None:
        self.flags[self.n_used + j] = 1.0

    def reduce(self, engine, group, direct: bool = False):
        """Start the sum over the ranks, behind the buckets on `engine` (a NativeEngine) or on
        comm's FIFO worker over `group`: it completes after them. direct: issued to the backend
        now (collectives.sum_async), where the buckets went too."""
        if self.t.is_cuda:  # pinned + non_blocking: the caching host allocator keeps the block
            # until the copy is done, so the next step cannot overwrite it early
            cpu = torch.device("cpu")  # cpu-literal: the pinned staging copy of the flags
            host = torch.tensor(self.flags, dtype=self.t.dtype, device=cpu, pin_memory=True)
            self.t.copy_(host, non_blocking=True)
        else:
            self.t.copy_(torch.tensor(self.flags, dtype=self.t.dtype, device=self.t.device))
        if direct:
            return sum_async(self.t, group, "sideband")
        if engine is not None:
            return engine.all_reduce(self.t, None, op="sum", name="sideband")
        return all_reduce(self.t, None, group, op="sum", async_op=True, name="sideband")

    def read(self, group) -> None:
        """After reduce()'s handle is done: used() and extra() answer for this step from now on,
        reading the sum from the device only when they need it (module docstring)."""
        self.own, self.summed, self._group = self.flags, None, group

    def local(self) -> None:
        """No exchange (a benchmark's bare mode): this rank's own flags are the answer."""
        self.own = self.summed = list(self.flags)

    def _sum(self) -> list:
        if self.summed is None:  # a dry run, which moved nothing, reads every parameter as
            # used and no extra flag set
            dry = [1.0] * self.n_used + [0.0] * (len(self.flags) - self.n_used)
            self.summed = read(self.t, dry, self._group)
        return self.summed

    def mine(self, i: int, k: int) -> bool:
        """Whether this rank had a gradient for bucket i's k-th parameter this step (before
        read(): then used() is True without the sum)."""
        return self.flags[self.first[i] + k] > 0

    def used(self, i: int, k: int) -> bool:
        """Whether some rank had a gradient for bucket i's k-th parameter (after read())."""
        j = self.first[i] + k
        return self.own[j] > 0 or self._sum()[j] > 0

    def extra(self) -> list[int]:
        return [int(f) for f in self._sum()[self.n_used:]]


def check_unchanged(module, named: list, after: str) -> None:
    """Raise if the module's trainable parameters are no longer `named` (those the reducer
    was built for): freezing, unfreezing or replacing one later would desynchronize the
    buckets silently. `after` ends "changed after ..." in the message."""
    params = [p for _, p in named]
    now = [p for p in module.parameters() if p.requires_grad]
    if len(now) == len(params) and all(a is b for a, b in zip(now, params)):
        return
    names = {id(p): n for n, p in module.named_parameters()}
    was, new = {id(p) for p in params}, {id(p) for p in now}
    added = [names[id(p)] for p in now if id(p) not in was]
    gone = [n for n, p in named if id(p) not in new]
    raise RuntimeError(f"the wrapped module's trainable parameters changed after {after} "
                       f"(added or unfrozen: {added or 'none'}; removed or frozen: "
                       f"{gone or 'none'}): wrap it again")


class ParamWatch:
    """check_unchanged() at every forward without walking the module each time (the walk: 0.4
    ms a forward on gpt-small on this 2-core EPYC, where DDP checks nothing). It walks when
    something may have changed the trainable parameters: a parameter or module registered
    anywhere since the last walk (torch's global registration hooks: a replaced or added
    parameter, an attached module), a requires_grad flipped on one of the module's parameters
    (a scan of their flags, ~5 us), or `suspect` (the last backward left a bucket short of
    gradients: a parameter unused, deleted, or replaced behind torch's back)."""

    def __init__(self, module, named: list, after: str):
        self.module, self.named, self.after = module, named, after
        self._remember()
        ref = weakref.ref(self)

        def touch(*_):  # a weak reference: the global hook must not keep this alive
            w = ref()
            if w is not None:
                w.dirty = True
        self._hooks = [torch_module.register_module_parameter_registration_hook(touch),
                       torch_module.register_module_module_registration_hook(touch)]

    def _remember(self) -> None:
        self.all = list(self.module.parameters())
        self.flags = [p.requires_grad for p in self.all]
        self.dirty = False

    def check(self, suspect: bool = False) -> None:
        if self.dirty or suspect or any(p.requires_grad is not f
                                        for p, f in zip(self.all, self.flags)):
            check_unchanged(self.module, self.named, self.after)
            self._remember()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
