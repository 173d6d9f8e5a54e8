"""ZeroOptimizer: a torch optimizer stepping this rank's fp32 master shards.

The inner optimizer (optim_cls(groups, **kwargs)) is built on the master shards (one 1-D fp32
tensor per parameter, exactly its `length` elements, layout.ParamShard), with the user's
param_groups mirrored: each parameter replaced by its shard, per-group options kept. Its
param_groups, state and defaults are this object's, so LR schedulers, state_dict() and
load_state_dict() work unchanged and opt.state holds this rank's shard of the state, keyed by
the master shards (as any torch optimizer keys its state by its own tensors).

A shard-local step is the full step only if the update of each element depends on that
element's gradient and state alone: PER_ELEMENT lists the torch optimizers that are (weight
decay, momentum, Adam's moments, Adagrad's sums are all per element). LBFGS (a line search over
the whole vector), Adafactor (factored row/column second moments) and SparseAdam (sparse
gradients) are not; anything else, subclasses of the listed ones included, is refused rather
than guessed about.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import pyfast.optim
from pyfast._ranges import ranged

PER_ELEMENT = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.ASGD, torch.optim.Rprop, pyfast.optim.AdamW)


def check_optimizer(optim_cls) -> None:
    if optim_cls not in PER_ELEMENT:
        name = getattr(optim_cls, "__name__", repr(optim_cls))
        raise ValueError(
            f"optim_cls={name} is not supported by zero: each rank steps its own shard of every "
            "parameter, which equals the full step only for an update that works element by "
            "element; supported: " + ", ".join(c.__name__ for c in PER_ELEMENT) + " (LBFGS, "
            "Adafactor, SparseAdam and other non-per-element optimizers are refused)")


class ZeroOptimizer(torch.optim.Optimizer):
    """See the module docstring. step(closure=None): finish the gradient reduction (stage 1:
    reduce-scatter now; stage 2: already done by backward), step the shards, then stage 1/2
    all-gather them into every rank's parameters (bit-identical replicas); stage 3 keeps the
    parameters sharded. zero_grad(set_to_none=True) clears the master shards' and the
    parameters' gradients. clip_grad_norm_(max_norm) clips by the global norm (one
    all-reduce per group: dp, tp, pp), since no rank holds a full gradient under stage 2/3."""

    def __init__(self, model, optim_cls, params=None, **kwargs):
        check_optimizer(optim_cls)
        self.model = model
        self.layout = model.layout
        if params is None:
            params = [p for p in model.module.parameters() if p.requires_grad]
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        trainable = {id(p) for p in model._params}
        names = {id(p): n for n, p in model.module.named_parameters()}
        mirrored = []
        for g in groups:
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            for p in ps:
                if id(p) not in trainable:
                    what = names.get(id(p))
                    raise ValueError(
                        f"params: {what!r} is frozen (requires_grad=False)" if what else
                        "params: a tensor that is not a parameter of the wrapped module")
            mirrored.append({**g, "params": [model.master(p) for p in ps]})
        self.shards = {sh.name: model.masters[u.index][i]
                       for u in self.layout.units for i, sh in enumerate(u.shards)}
        self.inner = optim_cls(mirrored, **kwargs)
        self._reduced = False
        # torch.optim.Optimizer's hooks and step patching; param_groups/state/defaults are the
        # inner optimizer's (properties below), re-added here group by group.
        torch.optim.Optimizer.__init__(self, list(self.inner.param_groups), self.inner.defaults)
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):  # torch's __init__ re-adds the mirrored groups
            raise NotImplementedError(
                "ZeroOptimizer.add_param_group: the shards are laid out when zero() wraps the "
                "module; pass every group as params= to zero()")
        super().add_param_group(param_group)

    # the inner optimizer's, so schedulers and state dicts see one set of groups
    param_groups = property(lambda self: self.inner.param_groups,
                            lambda self, v: setattr(self.inner, "param_groups", v))
    state = property(lambda self: self.inner.state, lambda self, v: setattr(self.inner, "state", v))
    defaults = property(lambda self: self.inner.defaults,
                        lambda self, v: setattr(self.inner, "defaults", v))

    def __setstate__(self, state: dict) -> None:
        """torch's load_state_dict ends in __setstate__({"state", "param_groups"}), which would
        write them into this object's __dict__, hidden behind the properties: they go to the
        inner optimizer instead (without this, load_state_dict loaded nothing, silently)."""
        state = dict(state)
        if "inner" in self.__dict__:
            for key in ("state", "param_groups", "defaults"):
                if key in state:
                    setattr(self.inner, key, state.pop(key))
        super().__setstate__(state)

    def reduce_gradients(self) -> None:
        """Finish this step's gradient reduction now (stage 1: the reduce-scatter; stage 2/3
        after no_sync: the accumulated gradients), so the master shards' .grad hold it: what a
        loss scaler's unscale_ and a norm need before step(). Idempotent until step()."""
        self._reduce()

    def _reduce(self) -> None:
        self.model._breaker.check()
        if self._reduced:
            return
        m = self.model
        # a Pipeline's backwards never pass zero's forward: whatever .grad holds is unreduced
        # (the caller may have reduced already: then every .grad is None)
        piped = m.pipeline and any(p.grad is not None for p in m._params)
        if m.stage == 1 or m._dirty or piped:
            m.reduce_gradients()
        else:
            m.finish()
        if m.stage == 1:
            for p in m._params:
                p.grad = None
        self._reduced = True

    def _grads(self) -> tuple[list, list]:
        """(this rank's master gradient shards, whether each counts in the norm here): a
        tp-replicated parameter (LayerNorm, a row-parallel bias: the same gradient on every tp
        rank) on tp rank 0 only; a tp shard, and everything without tp, everywhere (the shards
        over `group` are disjoint, and pp stages hold distinct parameters); with hybrid
        sharding on replica rank 0 only (the replicas hold the same shards)."""
        m = self.model
        tp0 = m.tp_group is None or dist.get_rank(m.tp_group) == 0
        reps = getattr(m, "replicas", None)
        rep0 = reps is None or reps.rank == 0
        grads, counted = [], []
        # offload: the host gradient shards (with delay=True not on the masters: HostShards)
        every = m._host.grads() if m._host is not None else \
            [[master.grad for master in ms] for ms in m.masters]
        for gs, flags in zip(every, m.tp_sharded):
            for g, tp in zip(gs, flags):
                if g is not None:
                    grads.append(g)
                    counted.append((tp or tp0) and rep0)
        return grads, counted

    @torch.no_grad()
    def norm_sq(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the squared global gradient norm, 1.0 if any of its gradient
        shards is NaN/Inf else 0.0), fp64 on the parameters' device, no collective: the shares
        summed over `group`, tp_group, pp_group (and a hybrid model's replica_group) are the
        squared norm torch's clip_grad_norm_ takes of the unsharded model's gradient. For a caller with an
        all-reduce of its own to ride on (the training job's one per step); then clip_(norm,
        max_norm)."""
        self._reduce()
        grads, counted = self._grads()
        dev = self.model._device
        if not grads:
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            return zero, zero.clone()
        # one fused pass (torch._foreach_norm, as torch's clip_grad_norm_), squared in fp64
        sq = torch.stack(torch._foreach_norm(grads)).double().square()
        mask = torch.tensor(counted, dtype=torch.bool, device=sq.device)
        bad = (~torch.isfinite(sq).all()).double()  # unmasked: a NaN anywhere is seen
        # offload: computed where the gradients are (the host); two fp64 scalars move, not them
        return torch.where(mask, sq, 0.0).sum().to(dev), bad.to(dev)

    @torch.no_grad()
    def clip_(self, total: torch.Tensor, max_norm: float) -> None:
        """Scale every gradient shard by torch's rule for the global norm `total`:
        max_norm / (total + 1e-6) where that is below 1. Clamped, not `if coef < 1` (torch's
        way): no host sync, and x * 1.0 is x exactly; a NaN norm makes NaN gradients, as
        torch.nn.utils.clip_grad_norm_ does."""
        grads, _ = self._grads()
        if grads:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            # offload: the scalar to the host gradients (on CUDA a sync the host step needs anyway)
            torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole (sharded) gradient: the total norm
        (returned) over dp, tp and pp, then clip_(). One all-reduce (sum of squares; max for
        inf) per group given: `group`, then tp_group and pp_group if zero() had them (distinct
        process groups: one collective cannot span them without a group over their union,
        which zero() is not given; the training job rides on its own step all-reduce instead,
        norm_sq)."""
        self._reduce()
        dev = self.model._device  # the parameters': a rank may hold no gradient shard
        norm_type = float(norm_type)
        reps = getattr(self.model, "replicas", None)
        groups = [self.model.group] + [g for g in (self.model.tp_group, self.model.pp_group,
                                                   reps.group if reps is not None else None)
                                       if g is not None]
        if norm_type == math.inf:
            grads, _ = self._grads()
            t = torch.stack([g.abs().max() for g in grads if g.numel()]).max().reshape(1) \
                .to(dev) if any(g.numel() for g in grads) else torch.zeros(1, device=dev)
            # (offload: the host gradients' max moves to the device for the group's backend)
            for g in groups:  # nothing in flight
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
            total = t[0]
        elif norm_type == 2.0:
            t = self.norm_sq()[0].reshape(1)  # fp64, as the job's norm
            for g in groups:  # nothing in flight (_reduce waited); comm's takes no fp64
                dist.all_reduce(t, group=g)
            total = t[0].sqrt()
        else:
            raise ValueError(f"clip_grad_norm_: norm_type 2 or inf, got {norm_type}")
        self.clip_(total, max_norm)
        return total.float()  # torch's clip_grad_norm_ returns the gradients' dtype

    @torch.no_grad()
    @ranged("pyfast.zero.step")
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce()
        host = self.model._host
        install = self.model.gather_params if self.model.stage < 3 else \
            self.model.refresh_device_shards  # (a no-op for stage 3 without offload)
        if host is None:
            self.inner.step()
        else:  # offload: the step on the host masters, installed (delay: the one before)
            host.step(self.inner, install)
        self._reduced = False
        self.model.settle_feedback(True)  # the step applied: keep its feedback memory
        if host is None:
            install()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False  # a skipped step (no step()) reduced gradients now thrown away
        host = self.model._host
        if host is not None and host.pending is not None:  # delay: the worker owns .grad
            host.clear_grads(set_to_none)
        for ms in self.model.masters if host is None or host.pending is None else []:
            for m in ms:
                if m.grad is not None:
                    if set_to_none:
                        m.grad = None
                    else:
                        m.grad.zero_()
        for p in self.model._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
