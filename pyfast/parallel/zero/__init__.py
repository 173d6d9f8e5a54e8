"""ZeRO-1/2/3: sharded data parallelism whose reduce-scatter (and stage 3's parameter
all-gather) go through pyfast's compressors. User guide: docs/zero.md.

    model, opt = pyfast.parallel.zero(module, torch.optim.AdamW, stage=2, lr=1e-3)
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

- layout.py: the sharding contract (which rank owns which elements, where they sit in the
  flat buffers); the checkpoint code reads it.
- model.py: ZeroModel, the wrapper, and the gradient reduce-scatter of stages 1/2.
- optimizer.py: ZeroOptimizer, a torch optimizer on this rank's fp32 master shards.
- stage3.py: parameters sharded between forwards, gathered per unit (FSDP2's scheme).
- frozen.py: stage 3's frozen parameters (a LoRA base) sharded and gathered as stored bytes
  (frozen="shard"), and the job's rule for choosing that placement.
- checkpoint.py: torch.distributed.checkpoint save/load, any world size; the full state dict.
- scaler.py: ZeroGradScaler, fp16 loss scaling on the shards (torch's ShardedGradScaler, fixed
  for ZeroOptimizer; imported from there: it pulls in torch.distributed.fsdp).
- meshes.py: zero on a tp / pp mesh (tp_group=, pp_group=, a Pipeline as the module).
- offload.py, offload_step.py: zero(offload=...): host buffers and copies; the host masters,
  gradients and step (docs/offload.md).

Memory per rank between steps, fp32 parameters, psi = parameter count, N ranks (measured in
tests/test_zero.py): DataParallel 16 psi bytes (params, grads, two Adam moments); stages 1 and 2:
4 psi (full params) + 4 psi / N (gradient shards) + 8 psi / N (state shards), the fp32 master
shard being a view of the parameter itself (16-bit parameters keep a separate fp32 master:
+ 4 psi / N); stage 2 differs from stage 1 in the peak during backward (full gradients of the
units not yet reduced instead of all of them). Stage 3: 16 psi / N (master, gradient and state
shards) between steps; while a unit runs, + its gathered parameters and the prefetched next ones
(the issue's "+ the largest gathered module": at most prefetch + 1 times that, prefetch=1 the
default).

Notes: `pyfast.parallel.zero` is the function (the issue's interface); reach the submodules with
`from pyfast.parallel.zero import layout` (an `import pyfast.parallel.zero.layout as x`
resolves the attribute, the function). Under stage 3, model.state_dict() holds the 0-element
parameters of between-steps: save and load through zero's checkpoint module. topk/randomk are
accepted for the reduce-scatter, but select within each rank's segment (all the unit's
parameters) rather than per parameter as DataParallel does. Not done yet: a `timeout=` (the
group's own applies).
"""
from __future__ import annotations

import math

import torch
import logging

import torch.distributed as dist
from torch import nn

import pyfast.compress as C
from pyfast.comm.agree import agree
from pyfast.comm.buckets import (BUCKET_MB, ENGINES, broadcast_state, check_params,
                                 check_same_layout)
from pyfast.comm.engine import NativeEngine, status as native_status
from pyfast.comm.weights import check_samples
from pyfast.parallel.samples import refuse_torchft

from .hybrid import Quorum, Replicas, check_replicas, check_torchft
from .frozen import (MODES as FROZEN_MODES, check_frozen, frozen_named, frozen_units,
                     segment_bytes)
from .layout import Layout, ParamShard, Unit, bucket_groups, shard_range, shard_size
from .meshes import check_pipeline, coords, tp_flags
from .model import ZeroModel
from .offload import Host, Offload, check_args as check_offload
from .optimizer import PER_ELEMENT, ZeroOptimizer, check_optimizer

log = logging.getLogger(__name__)
STAGES = (1, 2, 3)
PARAM_COMPRESSORS = (None, "none", "bf16", "fp16", "int8", "fp8")


def _first_difference(every: list) -> str:
    """The options or layouts of two ranks, at their first difference (not the whole list)."""
    bad = next(r for r, x in enumerate(every) if x != every[0])
    a, b = every[0], every[bad]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at = lambda xs: xs[i] if i < len(xs) else "nothing"  # noqa: E731
    return (f"ranks differ in their options or layout (stage, compressors, tp / pp coordinates, "
            f"bucket_mb, units): "
            f"rank 0 has {at(a)!r}, rank {bad} has {at(b)!r}")


def _grad_compressor(spec, error_feedback: bool, device=None):
    if spec == "auto":
        raise ValueError("compressor='auto' is DataParallel's per-bucket choice; zero takes one "
                         "compressor for every unit (e.g. 'int8')")
    c = C.get(spec)
    if c.algorithm == "powersgd":
        raise ValueError(f"compressor={c.spec!r}: the gradient reduce-scatter cannot use "
                         "powersgd (its factors need the whole matrix, each rank reduces a "
                         "shard of it); use a dense or sparse compressor such as 'int8'")
    return C.wrap(c, error_feedback, device)  # the memory on the parameters' device


def _engine_kinds(engine: str, c, pc, group, device, every_rank: bool = False) -> dict:
    """Who runs the reduce-scatters (compressor c) and the parameter all-gathers (pc): "native"
    where the engine can run and codes the compressor, unless engine="python"; engine="native"
    that cannot run raises ValueError naming why (no silent fallback). "auto" on a group smaller
    than the default one: python, since the engine's private group is made collectively over
    the default group, which a subgroup's zero() need not be called on (ask for "native"), unless
    every_rank says every rank of the default group calls zero() here (a mesh's groups).
    device: the parameters' (the engine runs CPU tensors, CUDA ones only in a CUDA build)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    ok, why = native_status(device)
    if engine == "auto" and not every_rank and dist.get_world_size(group) != dist.get_world_size():
        ok, why = False, "a subgroup (the engine's group is made over the default one)"
    if engine == "native" and not ok:
        raise ValueError(f"engine='native' cannot run: {why}; use engine='python' or 'auto'")
    kinds = {}
    for op, comp in (("reduce_scatter", c), ("all_gather", pc)):
        native = NativeEngine.supports(comp)
        if engine == "native" and not native:
            raise ValueError(f"engine='native' does not run compressor {comp.spec!r} for the "
                             f"{op} (dense deterministic compressors only: none, fp16, bf16, "
                             "int8, int4, fp8, sign); use engine='python' or 'auto'")
        kinds[op] = "native" if engine != "python" and ok and native else "python"
    if engine == "auto":  # once per zero(): which engine "auto" chose, and why not native
        log.info("zero(engine='auto') on %s: %s%s", device, kinds, f" ({why})" if why else "")
    return kinds


def zero(module: nn.Module, optim_cls, stage: int = 2, compressor=None, param_compressor=None,
         group=None, bucket_mb: float | None = None, error_feedback: bool = True, units=None,
         engine: str = "auto", frozen: str = "replicate", tp_group=None, pp_group=None,
         replica_group=None, replica_compressor=None, every_rank: bool = False,
         offload=None, prefetch: int = 1, delay: bool = False, replicas=None, samples=None,
         **optim_kwargs):
    """(model, opt): `module` wrapped for ZeRO stage 1, 2 or 3 over `group` (None: the default
    group), and a ZeroOptimizer running optim_cls(**optim_kwargs) on this rank's shards.
    optim_kwargs may hold params= (param groups, as optim_cls's first argument: lists of the
    module's parameters, or dicts with per-group options). Collective: every rank of the group
    calls it with the same module structure. Rank 0's parameters and buffers are broadcast.

    compressor: the gradient reduce-scatter's (a spec or Compressor; lossy ones get error
    feedback unless error_feedback=False). param_compressor: stage 3's parameter all-gather
    (None, "bf16", "fp16", "int8", "fp8"; the master shard stays fp32). bucket_mb: the size of
    stage 1/2 units (default DataParallel's 4 MB). units: stage 3's wrapped modules.

    engine: who runs the gradient reduce-scatters and the parameter all-gathers (every stage).
    "native": the C++ overlap engine (pyfast.comm.engine; no Python, no GIL on the path), for
    the dense deterministic compressors (none, fp16, bf16, int8, int4, fp8, sign), else
    ValueError naming the compressor (topk, randomk, ternary...). "python": comm.reduce_scatter
    / all_gather on comm's FIFO worker (every compressor). "auto": native where it can run,
    python otherwise, per collective (and python on a group smaller than the default group's
    unless every_rank=True: see below); model.engine_kind says which. Results, error-feedback
    memory and checkpoints are bitwise the same either way. The native engine has a process
    group of its own, made collectively over the default group
    (pyfast.comm.engine.private_group): with a subgroup, engine="native" needs every rank of the
    default group to call zero() at the same point (a mesh's data-parallel groups do;
    every_rank=True says so, and lets "auto" choose native on a subgroup: pyfast's training job
    passes it). Call model.close() before dist.destroy_process_group().

    frozen: where the parameters with requires_grad=False (a LoRA base) live. "replicate" (the
    default, every stage): whole on every rank, never communicated (after rank 0's are
    broadcast). "shard" (stage 3 only, else ValueError): each unit's frozen parameters are
    sharded like its trainable ones but kept in their own dtype and bytes (no master, state or
    gradient; never reduced), all-gathered as bytes right behind the unit's trainable gather
    (same prefetch and free) and freed after use: ~1/W of the frozen bytes a rank between steps
    (pyfast.parallel.zero.frozen). Stages 1/2 keep the base whole: they have no gather to
    piggyback on.

    tp_group, pp_group (meshes.py): `module` is this rank's tensor-parallel shard (tp_group: its
    tp group; required when it has parameters marked tensor_parallel) and / or a Pipeline stage
    (pp_group: the pipeline's group); `group` is then the dp x cp ranks holding the same tp / pp
    shard. They serve the one global gradient norm (opt.clip_grad_norm_) and the checkpoint's
    tp dimension. With a Pipeline, stages 1/2 reduce when the caller calls
    model.reduce_gradients() after the step's last backward; stage 3 gathers per layer.

    replica_group, replica_compressor: hybrid sharding (FSDP's HYBRID_SHARD; hybrid.py):
    everything is sharded over `group` (a node) and replicated across replica_group (the ranks
    holding this rank's shard in the other nodes); each unit's gradient shard, once
    reduce-scattered over `group`, is averaged over replica_group through replica_compressor
    (any compressor that codes a flat shard, error feedback per unit shard unless
    error_feedback=False; None: exact). The replicas stay bit-identical. Checkpoints
    (checkpoint.py) then add a leading Replicate() mesh dimension and run over the default
    group, as they do on a tp / pp mesh.

    replicas (a pyfast.parallel.ft.Replicas, torchft): hybrid sharding whose replica dimension
    is torchft's quorum (hybrid.Quorum): sharded over `group` (this replica group's dp ranks),
    each shard averaged over the participating replica groups through replica_compressor.
    Stage 2 only, no offload, no replica_group (FTError otherwise). Per step: R.start(),
    forward/backward, `if R.commit(): opt.step()`.

    samples: this rank's samples this step (an int; per step `model.samples = n` before the
    forward), for ranks with different batch sizes: each unit's gradients are weighted
    n / sum(n) in the reduce-scatter (and across the replicas under hybrid sharding), so the
    master shards get the gradient of the concatenated batch (model.py; docs/hetero.md).
    Shards stay even: only the batch is uneven. None: the plain mean. Not with replicas=
    (torchft: FTError).

    offload, prefetch, delay (offload.py): None (everything on the device), "optimizer"
    (ZeRO-Offload: the fp32 master shards, their gradients and the optimizer state in host
    memory, the step on the host) or "params" (stage 3: no device shard; each unit's host
    shard, and with frozen="shard" its frozen segment, copied to the device `prefetch` units
    ahead of its gather); delay=True: the one-step delayed update. prefetch (stage 3, any
    offload): the units whose all-gathers run ahead of the one computing (up to prefetch + 1
    units gathered at once; bitwise the same results for any depth); stages 1/2: 1 only."""
    if not dist.is_initialized():
        raise RuntimeError("zero needs torch.distributed initialized "
                           "(torchrun + dist.init_process_group)")
    check_samples(samples, "zero")  # a TypeError here, before any collective
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    check_optimizer(optim_cls)
    if bucket_mb is not None and bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    if param_compressor is not None and stage != 3:
        raise ValueError(f"param_compressor={param_compressor!r} compresses stage 3's parameter "
                         f"all-gather; stage {stage} gathers the updated parameters exactly")
    if param_compressor not in PARAM_COMPRESSORS:
        raise ValueError(f"param_compressor={param_compressor!r}: one of {PARAM_COMPRESSORS}")
    if frozen not in FROZEN_MODES:
        raise ValueError(f"frozen={frozen!r}: one of {FROZEN_MODES}")
    if frozen == "shard" and stage != 3:
        raise ValueError(f"frozen='shard' shards the frozen parameters between stage 3's "
                         f"gathers; stage {stage} keeps them whole on every rank "
                         "(frozen='replicate')")
    check_offload(offload, stage, prefetch, delay)
    if prefetch != 1 and stage != 3:
        raise ValueError(f"prefetch={prefetch} is how many units stage 3 gathers ahead; stage "
                         f"{stage} has no per-unit gather (leave prefetch=1)")
    if units is not None and stage != 3:
        raise ValueError(f"units= chooses stage 3's gathered modules; stage {stage} buckets "
                         "by bucket_mb")
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("zero: the module has no parameter with requires_grad=True to shard")
    tp_sharded = tp_flags(named, tp_group)
    check_pipeline(module, stage)
    c = _grad_compressor(compressor, error_feedback, named[0][1].device)
    if replicas is not None:
        check_torchft(stage, replica_group, offload)
        refuse_torchft("zero", samples)
    else:
        check_replicas(group, replica_group, replica_compressor)
    rc = None if replica_group is None and replicas is None else \
        _grad_compressor(replica_compressor, error_feedback, named[0][1].device)
    kinds = _engine_kinds(engine, c, C.get(param_compressor), group,  # before any collective
                          named[0][1].device, every_rank)
    check_params(named, "zero")
    fnamed = frozen_named(module, named) if frozen == "shard" else []
    check_frozen(fnamed, named[0][1].device)  # before any collective: the same on every rank
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # every block of either compressor codes one parameter's elements only (layout.py)
    pc = C.get(param_compressor)
    align = math.lcm(*(x.block if x.spec != "none" else 1 for x in (c, pc, rc) if x is not None))
    ft, replicas = replicas, None if replica_group is None else Replicas(replica_group, rc)
    if replicas is not None:  # the same layout and rank 0's state in every replica too
        check_same_layout(named, replica_group)
        broadcast_state(module, replica_group)
    elif ft is not None:  # torchft: every group builds the model from the same seed
        replicas = Quorum(ft, rc)
    check_same_layout(named, group)
    broadcast_state(module, group)
    off = None if offload is None else \
        Offload(offload, Host(named[0][1].device), prefetch, delay)
    if stage == 3:
        from .stage3 import Stage3Model, unit_groups
        groups, mods = unit_groups(module, named, units)
        layout = Layout(groups, world, rank, align, modules=mods)
        fgroups, fmods = unit_groups(module, fnamed, units) if fnamed else ([], [])
    else:
        fgroups, fmods = [], []
        layout = Layout(bucket_groups(named, bucket_mb or BUCKET_MB, world, align),
                        world, rank, align)
    fhost = off is not None and off.mode == "params"  # the frozen segments on the host too
    if off is not None:  # host memory short: OffloadError on every rank, before allocating
        from .offload_step import check as check_host
        problem = check_host(layout, off, optim_cls,
                             segment_bytes(fgroups, world) if fhost else 0)
        for g in ([replica_group] if replica_group is not None else []) + [group]:
            agree(None, problem, g, what="zero", device=named[0][1].device)
    funits = frozen_units(fgroups, fmods, world, rank, off.host if fhost else None)
    described = ([f"stage {stage}", f"compressor {c.spec}", f"param_compressor {param_compressor}"]
                 + (replicas.describe() if replicas is not None else [])
                 + coords(tp_group, pp_group) + [f"offload {offload} {prefetch} {delay}"]
                 + layout.describe()
                 + [d for f in funits for d in f.describe()])
    for g in ([replica_group] if replica_group is not None else []) + [group]:
        agree(described, None, g, what="zero", device=named[0][1].device,
              differ=_first_difference)
    if stage == 3:
        model = Stage3Model(module, layout, c, group, named, param_compressor, kinds, funits,
                            offload=off, prefetch=prefetch)
    else:
        model = ZeroModel(module, layout, stage, c, group, named, kinds, offload=off)
    model.replicas = replicas
    model.init_samples(samples)
    if ft is not None and getattr(c, "feedback", None) is not None:
        # the shard group's compressor memory too: kept by torchft's commit only
        model.stage_feedback(True)
        ft.on_commit(lambda: model.settle_feedback(True), lambda: model.settle_feedback(False))
    model.set_mesh(tp_group, pp_group, tp_sharded)
    opt = ZeroOptimizer(model, optim_cls, **optim_kwargs)
    return model, opt


__all__ = ["zero", "ZeroModel", "ZeroOptimizer", "PER_ELEMENT", "Layout", "ParamShard", "Unit",
           "bucket_groups", "shard_range", "shard_size"]
