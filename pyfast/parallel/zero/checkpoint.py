"""Checkpoints of a zero() model and its ZeroOptimizer through torch.distributed.checkpoint
(DCP): sharded (each rank writes its own shards), loadable at another world size or stage, and
a full (unsharded) state dict for export.

    save(path, model, opt)                  # dcp.save(get_state_dict(model, opt), ...)
    load(path, model, opt)                  # any world size, any stage
    sd = get_state_dict(model, opt); dcp.load(sd, checkpoint_id=path); set_state_dict(model, opt, sd)
    full = full_state_dict(model, opt)      # plain tensors in the parameters' shapes

The state dict mirrors torch.distributed.checkpoint.state_dict.get_state_dict's, keyed by the
wrapped module's FQNs (no "module." prefix):

    {"model": {fqn: tensor},                      # parameters and buffers
     "optim": {"state": {fqn: {"exp_avg": ..., "step": ...}},
               "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}}

- model, stages 1/2: the module's own tensors, plain and replicated (DCP writes them once).
  Stage 3: each trainable parameter as a DTensor of its flattened shape (n,) with Shard(0) on
  a 1-D DeviceMesh of the group, whose local tensor is this rank's fp32 master shard. A
  Shard(0) of the parameter's own shape would split rows, which is the flat split only when
  ceil(rows / W) * row = ceil(n / W): not at every world size, and a checkpoint's shapes must
  not depend on the world that wrote it. Buffers and frozen parameters: plain (frozen ones
  sharded by zero(frozen="shard") are not saved, and loading keeps a frozen parameter the
  checkpoint lacks as built).
- optim: each per-element state tensor (exp_avg, exp_avg_sq, momentum_buffer, ...) as a DTensor
  of shape (n,) with Shard(0), local = this rank's shard (opt.state's own tensor); scalars
  (step) plain. Layout (pyfast.parallel.zero.layout): rank r owns flat elements
  [r*s, min((r+1)*s, n)), s = ceil(n/W), which is exactly DTensor's (torch.chunk's) Shard(0)
  split, uneven last shards and empty ones included, so DCP reshards by itself. Stages 1/2
  with bf16/fp16 parameters add "fp32_master" (same form) to each parameter's state: their
  master shards are tensors of their own, and the model state holds only the rounded values.

load() builds what it reads from the checkpoint's metadata (a fresh optimizer has no state to
load into, and a parameter no rank ever used has none in the checkpoint) and accepts either
form of a parameter (a stage 1/2 checkpoint in a stage 3 model and back): a tensor of the
parameter's shape is read whole and sliced, one of shape (n,) as this rank's shard.

zero(offload=...): the host masters and state are saved as if they were on the device (the same
keys and shapes; "fp32_master" only where a run without offload has it), and loaded into the
host tensors, so a checkpoint resumes with or without offload (tests/test_zero_offload.py).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

_MESHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# the optimizer state's key for a stage 1/2 fp32 master shard that is not a view of its
# parameter (bf16/fp16 parameters): without it a resume would restart from the rounded values
MASTER = "fp32_master"


def _mesh(model):
    """The DeviceMesh of the model's shards (cached per model): 1-D over the shard group, with
    zero(tp_group=) a (tp, shard) dimension in front, and with hybrid sharding
    (zero(replica_group=...)) a leading replica dimension: (replica, [tp,] shard). The (tp,
    shard) ranks are tp_ranks[t] + group_ranks[g] - this rank (the offsets of a row-major mesh
    such as pyfast's Mesh and init_device_mesh); the replicas' rows come from one all-gather
    over replica_group (hybrid.Replicas.mesh_ranks). Replicate() over the replica dimension
    lets DCP write each shard once (its planner keeps one copy of identical chunks), so the
    checkpoint is the one a non-hybrid run of the same shards writes."""
    mesh = _MESHES.get(model)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh
        group = model.group if model.group is not None else dist.group.WORLD
        device = model._params[0].device.type  # zero() refuses a module without trainable ones
        tp, reps = getattr(model, "tp_group", None), getattr(model, "replicas", None)
        if tp is None and reps is None:
            mesh = DeviceMesh.from_group(group, device_type=device)
        else:
            me, shard = dist.get_rank(), dist.get_process_group_ranks(group)
            ranks = torch.tensor(shard) if tp is None else torch.tensor(
                [[t + g - me for g in shard] for t in dist.get_process_group_ranks(tp)])
            groups, names = [group], ["shard"]
            if tp is not None:
                groups, names = [tp] + groups, ["tp"] + names
            if reps is not None:
                ranks = reps.mesh_ranks(ranks, model._device)
                groups, names = [reps.group] + groups, ["replica"] + names
            mesh = DeviceMesh.from_group(groups, device, mesh=ranks,
                                         mesh_dim_names=tuple(names))
        _MESHES[model] = mesh
    return mesh


def _dtensor(model, local: torch.Tensor, fqn: str):
    """Parameter fqn's per-element value (this rank's shard `local`) as a DTensor: (n,) with
    Shard(0) over the shard group; with zero(tp_group=) a tp shard as (tp, n) with [Shard(0)
    over tp, Shard(1) over the group] (each tp rank's parameter has its own row: they hold
    different values under one FQN) and a tp-replicated one (n,) with [Replicate(), Shard(0)];
    with hybrid sharding a leading Replicate() over the replicas."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    n, mesh = model.layout.params[fqn].n, _mesh(model)
    lead = [Replicate()] if getattr(model, "replicas", None) is not None else []
    if getattr(model, "tp_group", None) is None:
        return DTensor.from_local(local, mesh, lead + [Shard(0)], run_check=False,
                                  shape=torch.Size([n]), stride=(1,))
    if _tp_shard(model, fqn):
        tp = dist.get_world_size(model.tp_group)
        return DTensor.from_local(local.view(1, -1), mesh, lead + [Shard(0), Shard(1)],
                                  run_check=False, shape=torch.Size([tp, n]), stride=(n, 1))
    return DTensor.from_local(local, mesh, lead + [Replicate(), Shard(0)], run_check=False,
                              shape=torch.Size([n]), stride=(1,))


def _group(model):
    """DCP's process group: the shard group, or every rank (the default group) on a mesh of
    more than one dimension: the replicas of a hybrid model must plan together for DCP to
    write each shard once, and the tp / pp shards of one checkpoint are written by ranks
    outside the shard group (one metadata file for all)."""
    alone = all(getattr(model, k, None) is None for k in ("replicas", "tp_group", "pp_group"))
    return model.group if alone else None


def _tp_shard(model, fqn: str) -> bool:
    sh = model.layout.params[fqn]
    return model.tp_sharded[sh.unit][model.layout.units[sh.unit].shards.index(sh)]


def _flat_size(model, fqn: str) -> tuple:
    """The checkpoint's shape of parameter fqn's flat form (_dtensor's)."""
    n = model.layout.params[fqn].n
    if getattr(model, "tp_group", None) is not None and _tp_shard(model, fqn):
        return (dist.get_world_size(model.tp_group), n)
    return (n,)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _names(model) -> dict:
    """FQN -> the layout's name of the same parameter (a tied parameter's every name maps to its
    first one), for the trainable parameters; FQN -> None for frozen parameters and buffers.
    Frozen parameters sharded by zero(frozen="shard") are left out: they are not saved (the
    job rebuilds the base from --model and --seed) and hold 0 elements between steps."""
    layout = model.layout
    first = {}
    for name, p in model.module.named_parameters(remove_duplicate=False):
        if name in layout.params:
            first[id(p)] = name
    sharded = {id(p) for f in getattr(model, "frozen", ()) for p in f.params}
    out = {}
    for name, p in model.module.named_parameters(remove_duplicate=False):
        if id(p) not in sharded:
            out[name] = first.get(id(p))
    for name, _ in model.module.named_buffers(remove_duplicate=False):
        out[name] = None
    return out


def _frozen(model) -> set:
    """FQNs of the frozen parameters (requires_grad=False)."""
    return {n for n, p in model.module.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def _tensors(model) -> dict:
    """FQN -> the module's own parameter or buffer (detached: shares its storage)."""
    m = model.module
    got = {n: p.detach() for n, p in m.named_parameters(remove_duplicate=False)}
    got.update({n: b.detach() for n, b in m.named_buffers(remove_duplicate=False)})
    return got


def _fqn_of_shard(opt) -> dict:
    return {id(t): fqn for fqn, t in opt.shards.items()}


def _model_state(model, opt) -> dict:
    own = _tensors(model)
    out = {}
    for fqn, first in _names(model).items():
        # tp: every stage, since tp ranks hold different values under one FQN
        tp = getattr(model, "tp_group", None) is not None
        if first is not None and (model.stage == 3 or tp):
            out[fqn] = _dtensor(model, opt.shards[first], first)
        else:
            out[fqn] = own[fqn]
    return out


def _param_groups(opt) -> list:
    names = _fqn_of_shard(opt)
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]


def _own_master(model, param: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether a stage 1/2 master shard is a tensor of its own (a bf16/fp16 parameter's fp32
    master), not a view of the parameter that the model state already holds."""
    if model.stage == 3:
        return False  # the model state is the masters
    if getattr(model, "_host", None) is not None:  # offload: host masters, saved as without
        return param.dtype != torch.float32 or not param.is_contiguous()  # (ZeroModel._master)
    return master.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()


def _optim_state(model, opt) -> dict:
    state, own = {}, _tensors(model)
    for fqn, shard in opt.shards.items():
        st = dict(opt.state.get(shard) or {})
        if _own_master(model, own[fqn], shard):
            st[MASTER] = shard
        if not st:
            continue
        entry = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.shape != shard.shape:
                    raise ValueError(
                        f"optimizer state {fqn}.{k} has shape {tuple(v.shape)}, not the shard's "
                        f"{tuple(shard.shape)}: only per-element state (or scalars) can be "
                        "sharded")
                entry[k] = _dtensor(model, v, fqn)
            else:
                entry[k] = v
        state[fqn] = entry
    return state


def get_state_dict(model, opt) -> dict:
    """{"model": ..., "optim": ...} of a zero() model and its optimizer (module docstring):
    this rank's shards as DTensors, the rest plain. Tensors are the live ones (no copy), so
    dcp.load into it fills the model and optimizer in place; call set_state_dict after.
    Offloaded shards and state (zero(offload=...)) are the host tensors under the same keys
    and shapes; with delay=True the step in flight is finished and installed first
    (ZeroModel.flush_offload: collective, as save is)."""
    if getattr(model, "_host", None) is not None:
        model.flush_offload()
    return {"model": _model_state(model, opt),
            "optim": {"state": _optim_state(model, opt), "param_groups": _param_groups(opt)}}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


@torch.no_grad()
def set_state_dict(model, opt, state: dict) -> None:
    """Install a state dict of get_state_dict's form (loaded by dcp.load, or full_state_dict's
    at any world size): every rank calls it (stages 1/2 end in the all-gather that rebuilds the
    replicated parameters from the master shards). Missing or unexpected keys are errors."""
    model_sd, optim_sd = state["model"], state["optim"]
    names, own = _names(model), _tensors(model)
    # fp32 masters first: loaded in place they may be the very shards the model state's
    # (rounded) parameters are about to be copied into
    masters = {fqn: _piece(model, fqn, entry[MASTER]).clone()
               for fqn, entry in optim_sd["state"].items() if MASTER in entry}
    frozen = _frozen(model)  # a checkpoint of a sharded base has none: kept as built
    missing = sorted(set(names) - set(model_sd) - frozen)
    unexpected = sorted(set(model_sd) - set(names))
    if missing or unexpected:
        raise KeyError(f"model state: missing {missing}, unexpected {unexpected}")
    for fqn, first in names.items():
        if fqn not in model_sd:  # a frozen parameter the checkpoint does not hold
            continue
        v = model_sd[fqn]
        if first is None:  # buffer or frozen parameter: whole everywhere
            if not _same(own[fqn], v):
                own[fqn].copy_(v)
            continue
        sh, master = model.layout.params[first], opt.shards[first]
        if not _is_dtensor(v) and v.numel() != sh.n:
            raise ValueError(f"{fqn}: {v.numel()} elements, the parameter has {sh.n}")
        local = _piece(model, first, v)
        if not _same(master, local):
            master.copy_(local)
    for fqn, m in masters.items():
        opt.shards[fqn].copy_(m)
    _set_optim(model, opt, optim_sd)
    _refresh(model)


def _piece(model, fqn: str, v) -> torch.Tensor:
    """This rank's shard of parameter fqn's per-element value v: a DTensor's local tensor, or
    the [start, start+length) slice of a whole (full_state_dict) tensor."""
    sh = model.layout.params[fqn]
    local = v.to_local().reshape(-1) if _is_dtensor(v) else \
        v.reshape(-1)[sh.start:sh.start + sh.length]
    if local.numel() != sh.length:
        raise ValueError(f"{fqn}: {local.numel()} elements, this rank's shard has {sh.length} "
                         "(a DTensor state dict must come from this world size; load() "
                         "reshards a checkpoint)")
    return local


def _set_optim(model, opt, optim_sd: dict) -> None:
    """Through the inner optimizer's own load_state_dict (integer keys, its param order)."""
    inner = opt.inner
    names = _fqn_of_shard(opt)
    order = [names[id(p)] for g in inner.param_groups for p in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    saved = optim_sd["param_groups"]
    if [g["params"] for g in saved] != [[names[id(p)] for p in g["params"]]
                                        for g in inner.param_groups]:
        raise ValueError("optimizer state: the checkpoint's param_groups list other parameters "
                         "(by FQN) than this optimizer's")
    state = {}
    for fqn, entry in optim_sd["state"].items():
        if fqn not in index:
            raise KeyError(f"optimizer state for {fqn!r}, which this optimizer does not step")
        st = {}
        for k, v in entry.items():
            if k == MASTER:  # set_state_dict installed it
                continue
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                st[k] = _piece(model, fqn, v).clone()
            else:
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
        if st:
            state[index[fqn]] = st
    groups = [{**g, "params": [index[f] for f in g["params"]]} for g in saved]
    inner.load_state_dict({"state": state, "param_groups": groups})


def _refresh(model) -> None:
    """The parameters from the (new) master shards: stages 1/2 all-gather them into the
    replicated parameters; stage 3 drops whatever it derived from the old shards."""
    if model.stage < 3:
        model.gather_params()
    else:
        model.refresh_device_shards()  # offload: the gather source from the new host masters
        refresh = getattr(model, "masters_changed", None)
        if refresh is not None:
            refresh()


def _key(*path) -> str:
    return ".".join(path)


def load_target(checkpoint_id, model, opt) -> dict:
    """What load() reads into (dcp.load, then set_state_dict), from the checkpoint's metadata:
    the model's tensors in the form the checkpoint holds them, the optimizer state the
    checkpoint has (nothing more), this rank's shards of this world size. For callers that add
    entries of their own to the same dcp.load (the training job's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    names, own, frozen = _names(model), _tensors(model), _frozen(model)
    model_sd = {}
    for fqn, first in names.items():
        k = _key("model", fqn)
        if k not in md and fqn in frozen:  # saved with the base sharded: kept as built
            continue
        if k not in md:
            raise KeyError(f"the checkpoint has no {k!r}")
        size = tuple(md[k].size)
        if first is None:
            model_sd[fqn] = own[fqn]
            continue
        sh = model.layout.params[first]
        if size == sh.shape and (model.stage < 3 or len(size) != 1):
            # whole (a stage 1/2 checkpoint): into the replicated parameter, or a temporary
            model_sd[fqn] = own[fqn] if model.stage < 3 else \
                torch.empty(size, dtype=md[k].properties.dtype, device=model._device)
        elif size == _flat_size(model, first):
            model_sd[fqn] = _dtensor(model, opt.shards[first], first)
        else:
            raise ValueError(f"{k}: the checkpoint holds shape {size}, the parameter is "
                             f"{sh.shape} ({sh.n} elements)")
    state = {}
    for fqn, shard in opt.shards.items():
        prefix = _key("optim", "state", fqn) + "."
        sh = model.layout.params[fqn]
        for k, m in md.items():
            if not k.startswith(prefix) or "." in k[len(prefix):]:
                continue
            if not isinstance(m, TensorStorageMetadata):
                raise ValueError(f"{k}: a non-tensor optimizer state value is not supported")
            entry = state.setdefault(fqn, {})
            name = k[len(prefix):]
            if len(m.size) == 0:
                entry[name] = torch.zeros((), dtype=m.properties.dtype)
            elif tuple(m.size) == _flat_size(model, fqn):
                # where the shard is: the parameters' device, as the mesh (_mesh), or
                # offload: the host (a device copy of the state is what offload avoids)
                local = torch.zeros(sh.length, dtype=m.properties.dtype, device=shard.device)
                entry[name] = _dtensor(model, local, fqn)
            else:
                raise ValueError(f"{k}: shape {tuple(m.size)}, expected "
                                 f"{_flat_size(model, fqn)}")
    return {"model": model_sd, "optim": {"state": state, "param_groups": _param_groups(opt)}}


def save(checkpoint_id, model, opt) -> None:
    """dcp.save of get_state_dict(model, opt): every rank writes its own shards (collective)."""
    import torch.distributed.checkpoint as dcp
    dcp.save(get_state_dict(model, opt), checkpoint_id=checkpoint_id,
             process_group=_group(model))


def load(checkpoint_id, model, opt) -> None:
    """Load a checkpoint written by save() at any world size and stage (collective)."""
    import torch.distributed.checkpoint as dcp
    target = load_target(checkpoint_id, model, opt)
    dcp.load(target, checkpoint_id=checkpoint_id, process_group=_group(model))
    set_state_dict(model, opt, target)


@torch.no_grad()
def full_state_dict(model, opt, rank0_only: bool = False) -> dict:
    """get_state_dict's form with every tensor whole and in its parameter's shape (optimizer
    state too), for export or a one-process run: collective (the shards are all-gathered).
    rank0_only: the other ranks return {}."""
    sd = get_state_dict(model, opt)
    shapes = {fqn: sh.shape for fqn, sh in model.layout.params.items()}
    names = _names(model)

    def whole(v, shape):  # a tp shard's (tp, n): this tp rank's row
        if not _is_dtensor(v):
            return v.detach().clone()
        t = v.full_tensor()  # the live local tensor itself where nothing is gathered
        t = t[dist.get_rank(model.tp_group)] if t.dim() == 2 else t  # (a group of one rank)
        return t.reshape(shape).clone()

    out_model = {fqn: whole(v, shapes[names[fqn]] if names[fqn] else v.shape)
                 for fqn, v in sd["model"].items()}
    out_state = {fqn: {k: whole(v, shapes[fqn]) if isinstance(v, torch.Tensor) and v.dim() > 0
                       else (v.clone() if isinstance(v, torch.Tensor) else v)
                       for k, v in entry.items()}
                 for fqn, entry in sd["optim"]["state"].items()}
    if rank0_only and dist.get_rank(model.group) != 0:
        return {}
    return {"model": out_model,
            "optim": {"state": out_state, "param_groups": sd["optim"]["param_groups"]}}


__all__ = ["get_state_dict", "set_state_dict", "full_state_dict", "save", "load", "load_target"]
