"""ZeRO stage 3: parameters sharded between uses, gathered per unit (FSDP2's scheme; read
torch/distributed/fsdp/_fully_shard/ for theirs).

Units: one per wrapped module (`units=`: module classes or module instances; default: every
module inside an nn.ModuleList, or, if there is none, every child of a root nn.Sequential --
pyfast's GPT is [Embed, Block..., Head]) and the root for the parameters left. A parameter
reached through two units (a tied embedding/head) belongs to their deepest common wrapped
ancestor: the root for GPT's tied weights. Unit order (the order the reduce-scatters are
launched in, on every rank): wrapped modules in reverse registration order, the root last.

Between steps every parameter's .data is a 0-element tensor (the nn.Parameter objects and their
FQNs are kept, so optimizers, state_dict keys and hooks still find them); this rank's fp32
master shards hold the values.
- forward pre-hook of a unit: wait for its prefetched all-gather or gather it now, and give each
  parameter a full tensor copied out of the gathered buffer; then start the all-gather of the
  next unit in the forward order recorded on the first forward (prefetch). Forward post-hook:
  free the unit's parameters (the root's stay until the end of backward).
- backward: a hook on the unit's forward outputs re-gathers the unit before autograd runs its
  backward; when the last gradient of the unit is accumulated (post-accumulate-grad hooks) the
  gradients are packed into the unit's buffer, the parameters freed, and the reduce-scatter
  launched in unit order (as stage 2).
- frozen="shard" (frozen.py): a unit's frozen parameters are gathered as their stored bytes
  right behind its trainable ones (one Handle for both, the same prefetch) and freed with them
  after forward; in backward only when the unit before it in forward order starts its backward
  (the unit's backward is then over: a norm weight autograd saved is still read until then).
  A module with frozen parameters only is a unit too (the root: embeddings, final norm, head).
- offload="params" (offload_step.py, docs/offload.md): no device shard; a unit's host segment
  (and frozen segment) is copied to a fresh device segment `prefetch` units before its gather
  is issued (_stage), the gather waits for the copy, and the device segment goes with the
  gather's buffers.
- param_compressor ("bf16", "fp16", "int8", "fp8", or None: exact fp32): each rank compresses
  its fp32 master segment once per gather and every rank decodes the same bytes, its own
  included, so the gathered parameters are bit-identical everywhere; no error feedback (the
  master stays exact, each step's gather quantizes it afresh).

Every collective (gathers, reduce-scatters, the side band) goes through one FIFO per engine
(model.py: the native engine's thread where the compressors allow, comm's FIFO worker
otherwise), so the ranks issue them in the same order on each group. Limits (as FSDP2's): a
parameter is full only inside its unit's forward and backward. A module that owns parameters
and runs outside its unit's forward (a unit's child called directly by the parent) raises a
RuntimeError naming the parameter and the unit (a forward pre-hook on every such module
checks); a parameter read without a module call (F.linear(x, other.weight) in another unit)
finds a 0-element tensor and fails with torch's shape error. This cannot be seen at
construction (it depends on what forward does): wrap the module that uses it, or leave the
parameter to the root.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import pyfast.compress as C
from pyfast._ranges import ranged
from pyfast.comm.collectives import Handle

from .meshes import is_pipeline, pipeline_units
from .model import ZeroModel


def _wrapped(module: nn.Module, units) -> list[tuple[str, nn.Module]]:
    """(name, module) of every wrapped module (not the root), in registration order."""
    named = list(module.named_modules())
    if units is None and is_pipeline(module):  # the stage's layers: Embed, Block, Head
        return pipeline_units(module)
    if units is not None:
        classes = tuple(u for u in units if isinstance(u, type))
        ids = {id(u) for u in units if isinstance(u, nn.Module)}
        for u in units:
            if not isinstance(u, (type, nn.Module)):
                raise TypeError(f"units=: module classes or submodules, got {type(u).__name__}")
        found = [(n, m) for n, m in named if n and (id(m) in ids or isinstance(m, classes))]
        missing = ids - {id(m) for _, m in found}
        if missing:
            raise ValueError(f"units=: {len(missing)} module(s) are not submodules of the module")
        return found
    found = [(f"{n}.{c}" if n else c, ch) for n, m in named if isinstance(m, nn.ModuleList)
             for c, ch in m.named_children()]
    if not found and isinstance(module, nn.Sequential):
        found = list(module.named_children())
    return found


def unit_groups(module: nn.Module, named: list, units) -> tuple[list, list]:
    """Stage 3's (groups of (FQN, parameter), their modules): one per wrapped module that
    owns parameters, in reverse registration order, then the root (None) with the rest."""
    wrapped = _wrapped(module, units)
    prefixes = [n + "." for n, _ in wrapped]
    trainable = {id(p) for _, p in named}
    owner: dict[int, str] = {}  # parameter -> the deepest wrapped prefix common to all paths
    for path, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in trainable:
            continue
        mine = max((pre for pre in prefixes if path.startswith(pre)), key=len, default="")
        if id(p) not in owner:
            owner[id(p)] = mine
        else:  # reached twice: the deepest wrapped prefix of both
            a, b = owner[id(p)], mine
            owner[id(p)] = max((pre for pre in prefixes + [""]
                                if a.startswith(pre) and b.startswith(pre)), key=len)
    groups, mods = [], []
    for (n, m), pre in reversed(list(zip(wrapped, prefixes))):
        members = [(fqn, p) for fqn, p in reversed(named) if owner[id(p)] == pre]
        if members:
            groups.append(members)
            mods.append(m)
    rest = [(fqn, p) for fqn, p in reversed(named) if owner[id(p)] == ""]
    if rest:
        groups.append(rest)
        mods.append(None)
    return groups, mods


@dataclass
class Gathered:
    """What one module's hooks gather and free: its trainable unit (layout.Unit) and its
    frozen unit (frozen.FrozenUnit, zero(frozen="shard")), either of which may be None."""
    index: int
    module: object
    t: object = None
    f: object = None


class Stage3Model(ZeroModel):
    """ZeroModel with parameters sharded between uses (module docstring)."""

    def __init__(self, module, layout, compressor, group, named, param_compressor=None,
                 engine_kind=None, frozen=None, offload=None, prefetch: int = 1):
        super().__init__(module, layout, 3, compressor, group, named, engine_kind, offload)
        self.depth = prefetch  # units gathered ahead (zero(prefetch=)): see _ahead
        self.param_compressor = C.get(param_compressor)
        self.frozen = list(frozen or [])  # FrozenUnits: frozen="shard"
        self.units: list[Gathered] = []
        at: dict[int, Gathered] = {}
        for u in layout.units:
            g = at[id(u.module)] = Gathered(len(self.units), u.module, t=u)
            self.units.append(g)
        for fu in self.frozen:  # a module with frozen parameters only gets a unit of its own
            g = at.get(id(fu.module))
            if g is None:
                g = at[id(fu.module)] = Gathered(len(self.units), fu.module)
                self.units.append(g)
            g.f = fu
        self._of_t = {g.t.index: g for g in self.units if g.t is not None}
        self._order: list[int] = []   # forward order of the units, recorded on the first forward
        self._recorded = False
        self._gathering: dict[int, tuple] = {}  # unit -> (handle, [full, frozen full, segs])
        # offload="params": unit -> its started host -> device copies, not yet gathered (_stage)
        self._host_params = offload is not None and offload.mode == "params"
        self._copies: dict[int, dict] = {}
        self._gathered = [False] * len(self.units)
        self._full: dict[int, torch.Tensor] = {}  # parameter -> its full tensor (see free)
        self._root = [g for g in self.units if g.module is None]
        for g in self.units:
            if g.module is not None:
                self._hooks.append(g.module.register_forward_pre_hook(self._pre(g)))
                self._hooks.append(g.module.register_forward_hook(self._post(g)))
        # every module that owns sharded parameters checks they are gathered before its forward
        # runs: one called outside its unit's forward gets this error instead of a shape mismatch
        self._sharded: dict[int, tuple] = {}  # parameter -> (its unit, its element count)
        for g in self.units:
            if g.t is not None:
                self._sharded.update({id(p): (g, sh.n) for p, sh in zip(g.t.params, g.t.shards)})
            if g.f is not None:
                self._sharded.update({id(p): (g, n) for p, n in zip(g.f.params, g.f.numels)})
        names = {id(m): n for n, m in module.named_modules()}
        for m in module.modules():
            own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) in self._sharded]
            if own:
                self._hooks.append(m.register_forward_pre_hook(self._check(names[id(m)], own)))
        self.free_all()

    def _check(self, mname: str, own: list):
        def hook(module, args):
            for n, p in own:
                g, numel = self._sharded[id(p)]
                if p.numel() == 0 and numel:
                    where = "the root" if g.module is None else \
                        f"unit {g.index} ({type(g.module).__name__})"
                    fqn = f"{mname}.{n}" if mname else n
                    raise RuntimeError(
                        f"zero stage 3: parameter {fqn!r} is sharded here: module {mname!r} ran "
                        f"outside the forward of {where}, which gathers it. Call it through that "
                        "unit's forward, or make it (or an ancestor that calls it) a unit: units=")
        return hook

    # ------------------------------------------------------------------ gathering
    def frozen_bytes(self) -> tuple[int, int]:
        """(this rank's stored frozen bytes, the frozen base's whole bytes) under frozen="shard"."""
        return sum(f.S for f in self.frozen), sum(f.nbytes for f in self.frozen)

    def _start(self, g) -> tuple:
        """Start g's all-gathers, trainable then frozen (one FIFO, the same order everywhere):
        (handle, [full, frozen full, the device segments they read...]); with
        offload="params" from the host copies staged for g (_stage), or staged now."""
        hs, fulls, segs = [], [None, None], []
        staged = self._copies.pop(g.index, {})
        if g.t is not None:
            seg = None
            if self._host_params:  # no device shard: its host copy, staged or now
                seg, copy = staged.get("t") or self._host.stage(g.t)
                copy.wait()  # the gather reads what the copy wrote
            h, fulls[0] = self._start_gather(g.t, self.param_compressor, seg)
            segs.append(seg)  # kept until gathered (None: made by _start_gather)
            hs.append(h)
        if g.f is not None:
            native = self.engine_kind["all_gather"] == "native"
            h, fulls[1], fseg = g.f.start_gather(self._engine if native else None,
                                                 self.group, staged.get("f"))
            segs.append(fseg if g.f.host is not None else None)  # (else: its own seg)
            hs.append(h)
        return Handle.of_all(hs), fulls + [t for t in segs if t is not None]

    def _stage(self, g) -> None:
        """offload="params": start g's host -> device copies (its trainable shards' segment
        and its frozen segment) now, ahead of its gather, unless g is gathered, being gathered
        or staged already."""
        if (self._host_params and not self._gathered[g.index] and g.index not in self._gathering
                and g.index not in self._copies):
            self._copies[g.index] = {"t": self._host.stage(g.t) if g.t is not None else None,
                                     "f": g.f.stage() if g.f is not None else None}

    def _fill(self, p, shape, write) -> None:
        """p.data <- its full tensor (the same storage each time, refilled), written by write."""
        t = self._full.get(id(p))
        if t is None:
            t = self._full[id(p)] = torch.empty(shape, dtype=p.dtype, device=p.device)
        elif t.untyped_storage().nbytes() == 0:  # freed: the same storage, refilled
            t.untyped_storage().resize_(t.numel() * t.element_size())
        with torch.autograd._unsafe_preserve_version_counter(t):
            write(t)
        p.data = t

    @ranged("pyfast.zero.gather")
    def gather(self, g) -> None:
        """Unit g's parameters full (from its prefetch if one is in flight)."""
        if self._gathered[g.index]:
            return
        h, (full, ffull, *_) = self._gathering.pop(g.index, None) or self._start(g)
        with self._breaker.guard(f"zero stage 3 all-gather of unit {g.index}"):
            h.wait()
        with torch.no_grad():
            if g.t is not None:
                for i, p in enumerate(g.t.params):
                    self._fill(p, g.t.shards[i].shape, lambda t: g.t.copy_out(full, i, t))
            if g.f is not None:
                for i, p in enumerate(g.f.params):
                    self._fill(p, g.f.shapes[i], lambda t: g.f.copy_out(ffull, i, t))
        self._gathered[g.index] = True

    def prefetch(self, g) -> None:
        if not self._gathered[g.index] and g.index not in self._gathering:
            self._gathering[g.index] = self._start(g)

    def free(self, g, frozen: bool = True) -> None:
        """The unit's parameters back to 0 elements, and their full storage released by
        resizing it to 0 bytes (FSDP2's way): autograd keeps views of the gathered weights for
        backward (F.linear saves weight.t()), and dropping only the reference would keep every
        unit's storage alive from its forward to its backward -- measured: a grad forward of 8
        units of 16 MB held 112 MB more than a no_grad one. gather() refills the same storage,
        so those views are valid again when backward reaches them. frozen=False: the trainable
        part only (its gradients are in; the frozen part may still be read by backward)."""
        params = (g.t.params if g.t is not None else []) + \
            (g.f.params if g.f is not None and frozen else [])
        for p in params:
            t = self._full.get(id(p))
            if t is not None:
                t.untyped_storage().resize_(0)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._gathered[g.index] = False

    def gather_all(self) -> None:
        """Every unit's parameters full (to look at them outside a step; free_all() after)."""
        for g in self.units:
            self.gather(g)

    def free_all(self) -> None:
        """Every parameter back to 0 elements (and any prefetch waited for and dropped)."""
        for h, _ in self._gathering.values():
            h.wait()
        self._gathering.clear()
        # host copies staged and never gathered (a no_grad forward's) are dropped: their
        # device segments are the allocator's once the copies ran (Host.to_device records
        # them on its stream), and the host step waits for that stream before it writes the
        # masters they read (Host.settle_h2d)
        self._copies.clear()
        for g in self.units:
            self.free(g)

    def masters_changed(self) -> None:
        """The master shards were replaced (a checkpoint load): drop what was gathered from the
        old ones; the next forward gathers the new."""
        self.free_all()

    def _next_in_order(self, g, step: int):
        if g.index not in self._order:
            return None
        j = self._order.index(g.index) + step
        return self.units[self._order[j]] if 0 <= j < len(self._order) else None

    def _ahead(self, g, direction: int, first: int = 1, last: int | None = None) -> list:
        """The units `first`..`last` (default: `depth`) places after g in the recorded forward
        order (direction 1: forward) or before it (-1: backward's order), nearest first: 1..depth
        are the gathers to have in flight while g runs. Memory bound: g's gathered parameters
        plus `depth` gathers in flight, so up to depth + 1 units' full parameters (and their
        gather buffers) live at once; depth 1 is FSDP2's default (one all-gather ahead).
        offload="params" stages the host -> device copies of the units depth+1..2*depth places
        ahead (their shards only: 1/W of a unit each), so each copy has `depth` units of
        compute to finish before its gather waits for it."""
        out = []
        for k in range(first, (self.depth if last is None else last) + 1):
            u = self._next_in_order(g, direction * k)
            if u is None:
                break
            out.append(u)
        return out

    def _pre(self, g):
        def hook(module, args):
            if not self._recorded and g.index not in self._order:  # once: a pipeline's
                self._order.append(g.index)  # micro-batches run the same units again
            for r in self._root:  # a Pipeline never calls forward(): its root (if any) here
                self.gather(r)
            self.gather(g)
            for nxt in self._ahead(g, 1):
                self.prefetch(nxt)
            for nxt in self._ahead(g, 1, self.depth + 1, 2 * self.depth):
                self._stage(nxt)
        return hook

    def _post(self, g):
        def hook(module, args, output):
            self.free(g)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0]
                           if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._before_backward(g))
            return output
        return hook

    def _before_backward(self, g):
        def hook(grad):
            # g's output gradient is complete, so the unit after g in forward order is done
            # with its backward: its frozen part (norm weights, dequantized bases' codes) goes
            nxt = self._next_in_order(g, 1)
            if nxt is not None and nxt.module is not None and (nxt.f is not None or
                                                                not self._armed):
                # not armed (a Pipeline, no_sync): nobody packs nxt's gradients (they stay
                # in .grad till the step's reduction), so its parameters are freed here
                self.free(nxt)
            self.gather(g)
            if self._armed:  # backward runs the forward order backwards
                for prev in self._ahead(g, -1):
                    self.prefetch(prev)
                for prev in self._ahead(g, -1, self.depth + 1, 2 * self.depth):
                    self._stage(prev)
            return grad
        return hook

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args, **kwargs):
        for g in self._root:
            self.gather(g)
        try:
            out = super().forward(*args, **kwargs)
        finally:
            self._recorded = True
        if not torch.is_grad_enabled():
            self.free_all()
        return out

    def _complete(self, i: int) -> None:
        """Trainable unit i's last gradient arrived: pack it and free its trainable parameters
        now (the root's stay until the end of backward; a frozen part until the unit's backward
        is over, _before_backward); comm.ready launches it in unit order."""
        u = self.layout.units[i]
        if u.module is not None:
            u.extra["packed"] = self._pack(u)
            self.free(self._of_t[i], frozen=False)

    def _final(self) -> None:
        super()._final()
        self.free_all()

    def reduce_gradients(self) -> None:
        """Reduce the accumulated .grad (after no_sync, or a Pipeline step's last backward:
        the unit order is then recorded, as a forward() records it) and free everything."""
        super().reduce_gradients()
        self._recorded = True
        self.free_all()
