"""zero() on a mesh: a module that is already tensor-parallel (pyfast.parallel.parallelize:
local shards marked `p.tensor_parallel = True`) and / or a pyfast Pipeline stage, ZeRO-sharded
over `group`, the dp x cp ranks that hold the same tp and pp shard (Megatron's distributed
optimizer under TP x PP; torchtitan's FSDP2 + TP + PP on a DeviceMesh).

- The layout, reduce-scatters and stage 3's all-gathers run over `group` only; tp parameters
  are sharded in their local shape. The ranks of `group` must hold the same tp and pp shard:
  their tp and pp coordinates join zero()'s layout agreement (coords), so a group that crosses
  a tp or pp group fails there, naming the two ranks and their coordinates (a tp shard has the
  same shape on every tp rank: the shapes alone would not tell).
- tp_group: needed when the module has tensor-parallel parameters (else ValueError): the one
  global gradient norm counts a tp-replicated tensor (LayerNorm, a row-parallel bias) on tp
  rank 0 only and sums the tp shards over tp (ZeroOptimizer.norm_sq); pp_group: every stage's
  squares are summed over pp. The checkpoint writes a tp shard as a (tp, n_local) DTensor
  (checkpoint.py).
- A Pipeline: stages 1/2 cannot reduce per unit while the schedule still runs other
  micro-batches' backwards through the same parameters: the caller reduces once after the
  rank's last backward of the step (model.reduce_gradients(), as DataParallel's under a
  pipeline); stage 3's units are the stage's layers (pipeline_units), gathered per
  micro-batch in forward and backward.
"""
from __future__ import annotations

import torch.distributed as dist


def is_pipeline(module) -> bool:
    from ..pipeline import Pipeline
    return isinstance(module, Pipeline)


def tp_flags(named: list, tp_group) -> list[bool]:
    """Per trainable parameter: whether it is a tensor-parallel shard. ValueError when the module
    has such shards but no tp_group was given (the norm would miss the other tp shards)."""
    flags = [bool(getattr(p, "tensor_parallel", False)) for _, p in named]
    if any(flags) and tp_group is None:
        first = next(n for (n, _), f in zip(named, flags) if f)
        raise ValueError(f"zero: the module is tensor-parallel ({sum(flags)} of {len(flags)} "
                         f"parameters are tp shards, e.g. {first!r}) but tp_group is None: pass "
                         "the tp group (mesh.tp_group) so the gradient norm and the checkpoint "
                         "cover every tp shard")
    return flags


def coords(tp_group, pp_group) -> list[str]:
    """What every rank of zero's group must share: its tp and pp coordinates."""
    out = []
    for name, g in (("tp", tp_group), ("pp", pp_group)):
        if g is not None:
            out.append(f"{name} rank {dist.get_rank(g)} of {dist.get_world_size(g)} "
                       f"(a zero group holds one {name} shard)")
    return out


def check_pipeline(module, stage: int) -> None:
    """Stage 3 regathers a unit per micro-batch in its backward hook and frees it when the unit's
    backward is over; a split backward (zb-h1's weight pass, or split_backward=True) runs the
    weight gradients later, after the unit was freed."""
    if stage != 3 or not is_pipeline(module):
        return
    split = sorted(s for s, on in module._split.items() if on)
    if split:
        why = f"schedule {module.schedule!r}" if module.schedule == "zb-h1" else \
            "split_backward=True"
        raise ValueError(f"zero stage 3 with a Pipeline whose {why} splits backward into input- "
                         f"and weight-gradient passes (stages {split}): the weight pass runs "
                         "after the unit was regathered and freed, so it cannot regather per "
                         "micro-batch; use stage 1 or 2, or a fused schedule (gpipe, 1f1b, "
                         "interleaved-1f1b with split_backward=False)")


def pipeline_units(module) -> list:
    """(name, module) of a Pipeline's layers: each stage's children (Embed, Block, Head)."""
    stages = {id(m) for m in module.stages.values()}
    return [(f"{n}.{c}" if n else c, ch) for n, m in module.named_modules()
            if id(m) in stages for c, ch in m.named_children()]
