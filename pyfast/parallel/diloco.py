"""DiLoCo and Streaming DiLoCo: an outer optimizer over replicas that synchronize rarely.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every replica takes H inner steps alone, then
the replicas average their pseudo-gradients (global - local) and an outer SGD with Nesterov
momentum moves the global parameters, which every replica then starts from. Streaming DiLoCo
(Douillard et al. 2025, arXiv 2501.18512): the parameters in F fragments, fragment f
synchronized every H steps at its own offset, its all-reduce running behind tau inner steps,
the local parameters then merged with the new global ones as alpha * local + (1 - alpha) *
global. User guide and the semantics in full: docs/diloco.md.

    dl = DiLoCo(model, inner_opt, sync_every=100, fragments=4, delay=2, compressor="int4",
                group=replica_group)
    loss = model(x, y); loss.backward(); dl.step(); dl.zero_grad()

A replica may be anything (DataParallel, ZeRO-1/2, tensor or pipeline parallel): DiLoCo sees
only this rank's parameters and `group`, the ranks that hold the same parameters in the other
replicas; the outer state (fp32 global parameters and momentum) follows the parameters'
device, or the CPU with offload=True.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import pyfast.compress as C
from pyfast import _dist
from pyfast.comm import all_gather, all_reduce
from pyfast.comm.collectives import Handle, check_backend
from pyfast.comm.agree import exchange_device
from pyfast.comm.dry import read
from pyfast.comm.failure import new_group_like
from pyfast.parallel import diloco_ft
from pyfast.parallel.data import broadcast_coalesced, check_same_layout

_INDEX = re.compile(r"^\d+$")


def _block(name: str) -> tuple[str, bool]:
    """The unit a parameter is assigned with: its name up to the first integer component
    ("blocks.3", "module.layers.11": a layer of a stack, numbered=True), else its module
    ("embed", "module.ln_f")."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INDEX.match(part):
            return ".".join(parts[:i + 1]), True
    return ".".join(parts[:-1]), False


def split_fragments(named: list[tuple[str, torch.Tensor]], fragments: int) -> list[list[int]]:
    """Indices into `named` (registration order) of each of `fragments` fragments, each list in
    registration order. Layers of a stack go round-robin (layer i -> fragment i % F: strided,
    which the Streaming DiLoCo paper found better than consecutive layers); every other module
    (embeddings, final norm, head) goes whole to the fragment with the fewest bytes, largest
    first. If that leaves a fragment empty (fewer units than fragments), tensors are assigned
    one by one instead, largest first, to the lightest fragment."""
    units: dict[str, list[int]] = {}
    numbered: dict[str, bool] = {}
    for i, (name, _) in enumerate(named):
        key, num = _block(name)
        units.setdefault(key, []).append(i)
        numbered[key] = num
    size = [p.numel() * p.element_size() for _, p in named]
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments

    def put(f, idx):
        out[f].extend(idx)
        load[f] += sum(size[i] for i in idx)

    layers = [k for k in units if numbered[k]]
    for j, k in enumerate(layers):
        put(j % fragments, units[k])
    rest = sorted((k for k in units if not numbered[k]),
                  key=lambda k: -sum(size[i] for i in units[k]))  # stable: ties by order
    for k in rest:
        put(min(range(fragments), key=lambda f: (load[f], f)), units[k])
    if any(not o for o in out):
        out, load = [[] for _ in range(fragments)], [0] * fragments
        for i in sorted(range(len(named)), key=lambda i: -size[i]):
            put(min(range(fragments), key=lambda f: (load[f], f)), [i])
    return [sorted(o) for o in out]


def fragment_due(t: int, sync_every: int, fragments: int) -> int | None:
    """The fragment sent after inner step t (t = 1, 2, ...), or None: fragment f when
    t % H == ((f + 1) * H / F) % H, so every fragment every H steps, H / F apart, and the last
    (for F = 1 the only) one at t = H, 2H, ..."""
    per = sync_every // fragments
    r = t % sync_every
    return (r if r else sync_every) // per - 1 if r % per == 0 else None


def _int(name: str, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"DiLoCo: {name} must be an integer, got {type(v).__name__} {v!r}")
    if v < low:
        raise ValueError(f"DiLoCo: {name} must be >= {low}, got {v}")
    return v


def _check_inner(model: nn.Module, inner_opt, named) -> None:
    if not isinstance(inner_opt, torch.optim.Optimizer):
        raise TypeError(f"DiLoCo: inner_opt must be a torch.optim.Optimizer, got "
                        f"{type(inner_opt).__name__}")
    if getattr(inner_opt, "model", None) is model:  # owns them through shards (ZeroOptimizer)
        # DiLoCo writes the parameters in place: ZeRO-1/2 with fp32 parameters steps views of
        # them; a separate 16-bit master copy (or stage 3's empty parameters) would not see it
        if getattr(model, "stage", 1) >= 3 or any(p.dtype != torch.float32 for _, p in named):
            raise ValueError("DiLoCo: ZeRO inside a replica needs stage 1 or 2 and float32 "
                             "parameters (the shards the optimizer steps are then views of "
                             "the parameters DiLoCo sets)")
        return
    held = {id(p) for g in inner_opt.param_groups for p in g["params"]}
    missing = [n for n, p in named if id(p) not in held]
    if missing:
        raise ValueError(f"DiLoCo: inner_opt does not hold {len(missing)} of the model's "
                         f"{len(named)} trainable parameters (first: {missing[0]!r}); build it "
                         "on model.parameters()")


def check_tiling(group, device: torch.device | None = None) -> None:
    """The replica groups (each rank's `group`) must partition the default group into groups
    of one size: each rank in exactly one, equal to the group of every rank in it. Collective
    over the default group (every rank calls it, members or not); every rank raises the same
    ValueError otherwise. A dry run (nothing exchanged) checks this rank's own group only."""
    world, me = dist.get_world_size(), dist.get_rank()
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    dev = exchange_device(None, device)
    mask = torch.zeros(world, dtype=torch.int64, device=dev)
    mask[members] = 1
    every = mask.new_zeros(world * world)
    _dist.all_gather_single(every, mask)
    rows = read(every.view(world, world), None)
    if rows is None:  # a dry run: every rank is taken to be this one
        if me not in members:
            raise ValueError(f"DiLoCo: this rank ({me}) is not in its replica group {members}")
        return
    sets = [frozenset(i for i, v in enumerate(row) if v) for row in rows]
    problem = next((f"rank {r} is not in its own replica group {sorted(s)}"
                    for r, s in enumerate(sets) if r not in s), None)
    if problem is None:
        problem = next((f"rank {r}'s replica group {sorted(sets[r])} and rank {q}'s "
                        f"{sorted(sets[q])} overlap but differ"
                        for r in range(world) for q in sets[r] if sets[q] != sets[r]), None)
    if problem is None and len({len(s) for s in sets}) > 1:
        problem = f"replica groups of different sizes: {sorted(set(map(tuple, map(sorted, sets))))}"
    if problem:
        raise ValueError(f"DiLoCo: the replica groups do not tile the world of {world} ranks: "
                         f"{problem}")


@dataclass
class _Pending:
    fragment: int
    sent_at: int
    flat: torch.Tensor
    handle: Handle
    full: torch.Tensor | None = None  # the averaged fragment, once gathered (inner_group)


class DiLoCo:
    """Wraps this rank's `inner_opt` on `model` (see the module docstring and docs/diloco.md).

    step(closure=None): the inner step, then, after inner step t (t = 1, 2, ...): fragment f is
    sent (its pseudo-gradient all-reduced) when t % H == ((f + 1) * H / F) % H and applied at
    t + delay (outer SGD on the global fragment, then local = lerp). zero_grad(set_to_none):
    the inner optimizer's. flush(): apply a fragment still in flight (at the end of training).
    close(): flush, stop the worker thread. state_dict() / load_state_dict(): the outer state.

    group: the replica group (None: the default group, every rank a replica). The replica
    groups of all ranks must tile the world (checked, collectively, at construction). At
    construction the model's parameters are broadcast from the group's rank 0 (the replicas
    start equal, as with DDP): load a checkpoint's model state after constructing DiLoCo.
    With delay > 0 the all-reduce runs on a worker thread while the caller goes on: NCCL and
    gloo pair a group's collectives in the order each rank issues them, so a collective the
    caller runs on the same group meanwhile could pair with it. The default group (None)
    therefore gets a private copy (new_group_like, made here); a group passed in must carry
    nothing else while a fragment is in flight (Mesh.replica_group is a group of its own).

    replicas: a pyfast.parallel.ft.Replicas (torchft): the replicas are then torchft's replica
    groups (group=None, delay 0): each outer step is a torchft step with its quorum, heal and
    commit (pyfast.parallel.diloco_ft; the caller registers its model and inner optimizer).

    inner_group: the ranks of this rank's replica holding the same parameters (DataParallel's
    or ZeRO-1/2's group; None: this rank alone). Each of its n ranks sends only its 1/n slice
    of every fragment to the same slice in the other replicas, and the averaged slices are
    all-gathered inside the replica (exactly, on the caller's thread when applied, when the
    inner group is idle): every byte crosses between replicas once instead of n times.
    Dense formats only (a per-tensor compressor's selection needs whole tensors).
    """

    def __init__(self, model: nn.Module, inner_opt, sync_every: int = 100, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1,
                 delay: int = 0, alpha: float = 0.0, compressor="int4",
                 error_feedback: bool = True, group=None, offload: bool = False,
                 inner_group=None, replicas=None):
        self.H = _int("sync_every", sync_every, 1)
        self.F = _int("fragments", fragments, 1)
        self.delay = _int("delay", delay, 0)
        if self.H % self.F:
            raise ValueError(f"DiLoCo: sync_every ({self.H}) must be a multiple of fragments "
                             f"({self.F}): fragment f is synchronized at offset f * H / F")
        if self.delay >= self.H // self.F:
            raise ValueError(f"DiLoCo: delay ({self.delay}) must be < sync_every / fragments "
                             f"({self.H // self.F}): a fragment's all-reduce must land before "
                             "the next fragment's starts")
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"DiLoCo: alpha must be in [0, 1], got {alpha}")
        if not float(outer_lr) > 0.0:
            raise ValueError(f"DiLoCo: outer_lr must be > 0, got {outer_lr}")
        if not 0.0 <= float(outer_momentum) < 1.0:
            raise ValueError(f"DiLoCo: outer_momentum must be in [0, 1), got {outer_momentum}")
        if nesterov and outer_momentum == 0:
            raise ValueError("DiLoCo: nesterov needs outer_momentum > 0 (as torch.optim.SGD); "
                             "pass nesterov=False for plain outer SGD")
        self.alpha, self.lr, self.momentum = float(alpha), float(outer_lr), float(outer_momentum)
        self.nesterov = bool(nesterov)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DiLoCo: the model has no trainable parameters")
        if self.F > len(named):
            raise ValueError(f"DiLoCo: fragments ({self.F}) > the model's {len(named)} "
                             "trainable parameter tensors: some fragment would be empty")
        _check_inner(model, inner_opt, named)
        base = C.get(compressor)  # ValueError / TypeError naming the valid specs
        if not dist.is_initialized():
            raise RuntimeError("DiLoCo needs torch.distributed initialized "
                               "(torchrun + dist.init_process_group)")
        dtypes = {p.dtype for _, p in named} - {torch.float32, torch.bfloat16, torch.float16}
        if dtypes:
            raise TypeError(f"DiLoCo: parameters must be float32, bfloat16 or float16, got "
                            f"{sorted(map(str, dtypes))}")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"DiLoCo: parameters on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        check_backend(self.device, group, "DiLoCo's outer all-reduce")  # CUDA needs NCCL
        self.ft = replicas  # torchft's replica groups (diloco_ft): no tiling, no broadcast
        if replicas is not None:
            diloco_ft.check(self, replicas, group, self.delay)
        else:
            check_tiling(group, self.device)
        self.model, self.inner_opt, self.group = model, inner_opt, group
        self.replicas = dist.get_world_size(group) if replicas is None else None
        # the all-reduce's own group: a private copy of the default group behind a delay (the
        # class docstring); collective over the default group, as check_tiling
        default = group is None or group is dist.group.WORLD
        self._comm = new_group_like(None) if self.delay and default else group
        self.inner_group = inner_group
        self.inner = 1 if inner_group is None else dist.get_world_size(inner_group)
        self._inner_rank = 0 if inner_group is None else dist.get_rank(inner_group)
        if replicas is None:  # under torchft every group builds from one seed (init_sync off)
            check_same_layout(named, group)
            broadcast_coalesced([p for _, p in named], group)

        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.fragments = [[self.names[i] for i in idx] for idx in split_fragments(named, self.F)]
        self._index = {n: i for i, n in enumerate(self.names)}
        self.offload = bool(offload)
        # the dry run's meta parameters keep a meta outer state: nothing there is real memory
        host = torch.device("cpu")  # cpu-literal: offload=True keeps the outer state there
        where = host if offload and self.device.type != "meta" else self.device
        with torch.no_grad():
            self.global_params = {n: p.detach().to(where, torch.float32, copy=True)
                                  for n, p in named}
            self.momentum_buffers = ({n: torch.zeros_like(g) for n, g in self.global_params.items()}
                                     if self.momentum else {})
        self.compressor = C.wrap(base, error_feedback, self.device)
        dense = self.compressor.algorithm == "dense"
        if self.inner > 1 and self.compressor.per_tensor:
            raise ValueError(f"DiLoCo: compressor {self.compressor.spec!r} selects or factors "
                             "whole tensors, which an inner_group's slices of a fragment are "
                             "not: use a dense format (none, bf16, int8, int4, e3m0, fp8) or "
                             "inner_group=None")
        # dense formats: "allgather", each rank's pseudo-gradient compressed once, every rank
        # decoding all of them and summing in fp32 in rank order (two-phase would compress the
        # partial sums a second time)
        self.algorithm = "allgather" if dense else None
        self.step_count = 0
        # bytes of this rank's compressed pseudo-gradients so far (each goes to R - 1 peers);
        # None for formats whose size depends on the data or the shapes (top-k, PowerSGD, ...)
        self.payload_bytes = 0 if self.compressor.algorithm in ("dense", "native") else None
        self._pending: _Pending | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pyfast-diloco")
        if replicas is not None:
            diloco_ft.attach(self, replicas)

    # ------------------------------------------------------------------ the loop
    def step(self, closure=None):
        loss = self.inner_opt.step(closure) if closure is not None else self.inner_opt.step()
        self.step_count += 1
        t = self.step_count
        p = self._pending
        if p is not None and p.sent_at + self.delay == t:
            self._apply()
        f = fragment_due(t, self.H, self.F)
        if f is not None and self.ft is not None:  # one torchft step (diloco_ft)
            diloco_ft.outer_step(self)
        elif f is not None:
            self._send(f, t)
            if self.delay == 0:
                self._apply()
        return loss

    def due(self, t: int) -> int | None:
        """The fragment sent after inner step t, or None (fragment_due)."""
        return fragment_due(t, self.H, self.F)

    def _apply_reduced(self, f: int, t: int, flat: torch.Tensor, avg: torch.Tensor) -> None:
        """Apply fragment f's averaged pseudo-gradient `avg` (this rank's slice) now: the
        outer step of a reduction already done on the caller's thread (diloco_ft)."""
        self._pending = _Pending(f, t, flat, Handle(lambda timeout: (avg, 0.0)))
        self._apply()

    @property
    def in_flight(self) -> _Pending | None:
        """The fragment whose all-reduce has started and whose outer step is not applied yet."""
        return self._pending

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_opt.zero_grad(set_to_none=set_to_none)

    def flush(self) -> None:
        """Apply the fragment still in flight now (end of training: its all-reduce is done)."""
        if self._pending is not None:
            self._apply()

    def close(self) -> None:
        self.flush()
        self._worker.shutdown(wait=True)

    def _views(self, f: int, flat: torch.Tensor):
        o = 0
        for n in self.fragments[f]:
            p = self.params[self._index[n]]
            yield n, p, flat[o:o + p.numel()].view(p.shape)
            o += p.numel()

    def _send(self, f: int, t: int) -> None:
        assert self._pending is None, "delay < H / F keeps one fragment in flight"
        n = sum(self.params[self._index[m]].numel() for m in self.fragments[f])
        flat = torch.empty(n, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for name, p, d in self._views(f, flat):
                d.copy_(self.global_params[name])
                d.sub_(p.detach())  # global - local, fp32 (a bf16 local widens exactly)
        mine = self._slice(flat)
        if self.payload_bytes is not None:
            k = mine.numel()
            self.payload_bytes += (self.compressor.wire_bytes(k)
                                   if self.compressor.algorithm == "dense" else 4 * k)
        h = Handle.on_worker(self._reduce, mine, f, executor=self._worker)
        self._pending = _Pending(f, t, flat, h)

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a fragment: all of it, or with an inner group of n ranks its
        1/n slice (ceil(numel / n) elements, the last one zero-padded)."""
        if self.inner == 1:
            return flat
        S = -(-flat.numel() // self.inner)
        mine = flat.new_zeros(S)
        lo = min(flat.numel(), self._inner_rank * S)
        hi = min(flat.numel(), lo + S)
        mine[:hi - lo].copy_(flat[lo:hi])
        return mine

    def _averaged(self, p: _Pending) -> torch.Tensor:
        """The fragment's averaged pseudo-gradient, whole: with an inner group, the averaged
        slices all-gathered exactly inside the replica (on the caller's thread: collective over
        the inner group, whose ranks all apply or save at the same step)."""
        if p.full is None:
            avg = p.handle.wait()
            if self.inner > 1:
                whole = avg.new_empty(avg.numel() * self.inner)
                all_gather(whole, avg.contiguous(), None, self.inner_group,
                           name=f"diloco.f{p.fragment}.gather")
                avg = whole[:p.flat.numel()]
            p.full = avg
        return p.full

    def _reduce(self, flat: torch.Tensor, f: int) -> torch.Tensor:
        name = f"diloco.f{f}"
        if self.compressor.per_tensor:  # a selection or a factorization per parameter
            for pname, _, d in self._views(f, flat):
                all_reduce(d, self.compressor, self._comm, op="avg", name=f"{name}.{pname}")
            return flat
        return all_reduce(flat, self.compressor, self._comm, op="avg", name=name,
                          algorithm=self.algorithm)

    def _apply(self) -> None:
        p, self._pending = self._pending, None
        avg = self._averaged(p)
        m, lr = self.momentum, self.lr
        with torch.no_grad():
            for name, param, d in self._views(p.fragment, avg):
                g = self.global_params[name]
                d = d.to(g.device)
                # torch.optim.SGD (dampening 0, no weight decay), op for op
                if m:
                    buf = self.momentum_buffers[name]
                    buf.mul_(m).add_(d)
                    d = d.add(buf, alpha=m) if self.nesterov else buf
                g.add_(d, alpha=-lr)
                new = g.to(param.device)
                if self.alpha:  # Streaming DiLoCo's merge: alpha * local + (1 - alpha) * global
                    new = torch.lerp(param.detach().float(), new, 1.0 - self.alpha)
                param.copy_(new)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The outer state (waits for a fragment in flight; its averaged pseudo-gradient is
        saved). Tensors are the live ones (copy before training on). Layout: docs/diloco.md."""
        pending = {}
        if self._pending is not None:
            p = self._pending
            pending = {"fragment": p.fragment, "sent_at": p.sent_at, "delta": self._averaged(p)}
        return {
            "step": self.step_count,
            "schedule": {"sync_every": self.H, "fragments": self.F, "delay": self.delay,
                         "members": [list(f) for f in self.fragments]},
            "global": dict(self.global_params),
            "momentum": dict(self.momentum_buffers),
            "pending": pending,
            # per replica (each replica's own residuals): the compressor's error-feedback memory
            # keyed by "diloco.f<fragment>[.<chunk>]", and its own state (seeds, warm starts)
            "compression": self.compressor.state_dict(),
            "payload_bytes": self.payload_bytes,
        }

    def load_state_dict(self, state: dict) -> None:
        if self._pending is not None:  # never leave a reduction running behind the caller
            self._pending.handle.wait()
        sched = state["schedule"]
        mine = {"sync_every": self.H, "fragments": self.F, "delay": self.delay,
                "members": [list(f) for f in self.fragments]}
        if {k: sched.get(k) for k in mine} != mine:
            diff = [k for k in mine if sched.get(k) != mine[k]]
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint's schedule differs in "
                             f"{diff}: saved {[sched.get(k) for k in diff]}, now "
                             f"{[mine[k] for k in diff]}")
        for key, dst in (("global", self.global_params), ("momentum", self.momentum_buffers)):
            src = state[key]
            if set(src) != set(dst):
                raise ValueError(f"DiLoCo.load_state_dict: {key!r} holds {sorted(src)[:3]}..., "
                                 f"this model {sorted(dst)[:3]}... ({len(src)} vs {len(dst)})")
            with torch.no_grad():
                for n, t in dst.items():
                    if src[n].shape != t.shape:
                        raise ValueError(f"DiLoCo.load_state_dict: {key}[{n!r}] has shape "
                                         f"{tuple(src[n].shape)}, expected {tuple(t.shape)}")
                    t.copy_(src[n])
        # absent (a resume with another number of replicas: residuals are per replica): the
        # error-feedback memory starts empty, as at step 0
        comp = state.get("compression", {})
        if isinstance(self.compressor, C.WithFeedback):
            self.compressor.load_state_dict(comp, self.device)
        elif comp:
            self.compressor.load_state_dict(comp)
        self.step_count = int(state["step"])
        if self.payload_bytes is not None:
            self.payload_bytes = int(state.get("payload_bytes") or 0)
        pend = state["pending"]
        self._pending = None
        if pend:
            flat = pend["delta"].to(self.device, torch.float32, copy=True)
            done = Handle(lambda timeout: (flat, 0.0))
            self._pending = _Pending(int(pend["fragment"]), int(pend["sent_at"]), flat, done,
                                     full=flat)
