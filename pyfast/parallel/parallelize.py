"""parallelize(model, plan): tensor parallelism for any model, by module name.

Like torch's `parallelize_module(model, mesh, plan)`, but the plan's values are style names and
the modules become pyfast's (pyfast.parallel.tensor / .vocab), swapped in place:

    plan = {"layers.*.attn.qkv": "colwise", "layers.*.attn.proj": "rowwise",
            "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}
    parallelize(model, plan, group=tp_group)

Styles (CONVERTERS says which module types each can shard):
    colwise      nn.Linear    -> ColumnParallelLinear: output features split, input whole
    rowwise      nn.Linear    -> RowParallelLinear: input features split (what a colwise layer
                                 returns), output all-reduced, whole
    colwise_sp   nn.Linear    -> ColumnParallelLinear(sequence_parallel=True): the input is this
                                 rank's slice of the sequence (all-gathered)
    rowwise_sp   nn.Linear    -> RowParallelLinear(sequence_parallel=True): the output is this
                                 rank's slice of the sequence (reduce-scattered)
    vocab        nn.Embedding -> VocabParallelEmbedding: the vocabulary split
Aliases: "column" and torch's "ColwiseParallel" mean colwise; "row" and "RowwiseParallel"
rowwise. A plan value is a style, or (style, options) with options passed to the converter,
e.g. ("colwise", {"gather_output": True}) for a language-model head. `sequence_dim` is the
default sequence dimension of the *_sp styles (0 as Megatron's [s, b, h]; 1 for [b, s, h]).

Patterns match dotted module names atom by atom with fnmatch (as torch does): "layers.*.fc1"
matches "layers.3.fc1", not "layers.3.mlp.fc1". Every pattern must match at least one module,
and every matched module must be of a type its style can shard; the model is left untouched
unless the whole plan converts. Types match exactly: a subclass of nn.Linear may not compute
F.linear (MultiheadAttention's out_proj is read, never called), so it needs its own entry.
Nothing here knows a model: a new module type or style is a new entry in CONVERTERS.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Callable

import torch.distributed as dist
from torch import nn

from .tensor import ColumnParallelLinear, RowParallelLinear


def _vocab(embedding, group, **options):
    from .vocab import VocabParallelEmbedding  # imported when a plan asks for it
    return VocabParallelEmbedding.from_embedding(embedding, group=group, **options)


CONVERTERS: dict[tuple[str, type], Callable[..., nn.Module]] = {
    ("colwise", nn.Linear): lambda m, group, **o: ColumnParallelLinear.from_linear(
        m, group=group, **o),
    ("rowwise", nn.Linear): lambda m, group, **o: RowParallelLinear.from_linear(
        m, group=group, **o),
    ("colwise_sp", nn.Linear): lambda m, group, **o: ColumnParallelLinear.from_linear(
        m, group=group, sequence_parallel=True, **o),
    ("rowwise_sp", nn.Linear): lambda m, group, **o: RowParallelLinear.from_linear(
        m, group=group, sequence_parallel=True, **o),
    ("vocab", nn.Embedding): _vocab,
}
ALIASES = {"column": "colwise", "ColwiseParallel": "colwise",
           "row": "rowwise", "RowwiseParallel": "rowwise"}
SEQUENCE_PARALLEL = {"colwise_sp", "rowwise_sp"}


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(a, b) for a, b in zip(n, p))


def _style(pattern: str, spec, tp: int) -> tuple[str, dict]:
    style, options = (spec, {}) if isinstance(spec, str) else spec
    style = ALIASES.get(style, style)
    if not any(s == style for s, _ in CONVERTERS):
        known = sorted({s for s, _ in CONVERTERS} | set(ALIASES))
        raise ValueError(f"parallelize: pattern {pattern!r} has style {style!r}; known styles: "
                         f"{', '.join(known)} (tensor-parallel size {tp})")
    return style, dict(options)


def parallelize(model: nn.Module, plan: dict, group=None, *, sequence_dim: int = 0) -> nn.Module:
    """Swap the modules `plan` names for their tensor-parallel versions over `group` (None:
    the default group), copying this rank's shard of their weights. Returns the model (the
    converted module itself if the plan names the root, "")."""
    tp = dist.get_world_size(group)
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, str, dict]] = {}  # name -> (pattern, style, options)
    for pattern, spec in plan.items():
        style, options = _style(pattern, spec, tp)
        if style in SEQUENCE_PARALLEL:
            options = {"sequence_dim": sequence_dim, **options}
        hits = [n for n in modules if _matches(pattern, n)]
        if not hits:
            some = ", ".join(repr(n) for n in list(modules)[1:7])
            raise ValueError(f"parallelize: pattern {pattern!r} ({style}) matches no module of "
                             f"{type(model).__name__} (names look like {some}; tensor-parallel "
                             f"size {tp})")
        for n in hits:
            if n in chosen and chosen[n][1:] != (style, options):
                raise ValueError(f"parallelize: {n!r} is matched by {chosen[n][0]!r} "
                                 f"({chosen[n][1]}) and by {pattern!r} ({style}) "
                                 f"(tensor-parallel size {tp})")
            chosen[n] = (pattern, style, options)
    for n, (pattern, style, _) in chosen.items():
        if (style, type(modules[n])) not in CONVERTERS:
            can = ", ".join(t.__name__ for s, t in CONVERTERS if s == style)
            raise ValueError(f"parallelize: {n!r} (pattern {pattern!r}) is a "
                             f"{type(modules[n]).__name__}, which style {style!r} cannot shard "
                             f"(it shards {can}; tensor-parallel size {tp})")
    # convert everything before swapping anything: a failing entry leaves the model as it was
    new = {n: CONVERTERS[style, type(modules[n])](modules[n], group, **options)
           for n, (_, style, options) in chosen.items()}
    for n, m in new.items():
        if not n:
            return m
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent), child, m)
    return model
