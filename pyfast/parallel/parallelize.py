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
    sequence_norm, sequence_scatter, sequence_gather   any module, kept as it is (hooks):
                 the sequence-sharded regions between *_sp layers (sequence_parallel.py)
    colwise_qkv  nn.Linear    -> ColumnParallelLinear of a fused QKV projection, checked against
                                 the layout rule below; options heads= (required), kv_heads=
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
LoRA: a pattern that matches peft's lora.Linear wrapper (pyfast.models.lora) splits its base in
the style (a Linear style, or a bf16 QuantLinear base) and its adapters to match
(pyfast.parallel.lora_tp; imported only when peft is, so a model without adapters never pays
for importing peft).

Fused QKV layout rule (Megatron's; pyfast.models.gpt's): the rows of a fused projection are
ordered [kv group, (q of the group's heads/kv_heads query heads, k, v), head_dim], i.e. for
plain multi-head attention (kv_heads = heads) [head, (q, k, v), head_dim]. A colwise split into
tp contiguous blocks then hands each rank whole kv groups with their q, k and v together, and
the attention code infers its local head count from the width it gets. The rule is checkable
only in its sizes: "colwise_qkv" refuses unless kv_heads divides heads, tp divides kv_heads and
out_features = kv_heads * (heads/kv_heads + 2) * head_dim; the row order is the model's promise
(`fuse_qkv` builds it from separate q, k, v weights). The [(q, k, v), head, head_dim] layout
(GPT-2's c_attn) split the same way would give rank 0 all of q and part of k, silently: fuse
it with fuse_qkv first.

Tied weights: a parameter shared by several modules (an embedding and its LM head) stays one
parameter if every module sharing it is converted and their shards of it are the same slice
("vocab" and "colwise": both hold vocabulary rows [r*V/tp, (r+1)*V/tp)); a module object reached
under several names is converted once and swapped in under each. Anything else (one of them
left whole, or sharded along another dimension) raises, naming both modules: parallelize never
unties silently.

Failures: `timeout=` runs every converted module on one private group with that timeout (made
here, collectively), and all of them share one Breaker: after a failed collective in any of
them every one refuses further steps.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pyfast._patterns import matches as _matches
from pyfast.comm.failure import Breaker, new_group_like

from .tensor import ColumnParallelLinear, RowParallelLinear


def _vocab(embedding, group, **options):
    from .vocab import VocabParallelEmbedding  # imported when a plan asks for it
    return VocabParallelEmbedding.from_embedding(embedding, group=group, **options)


def _qkv_sizes(out_features: int, heads, kv_heads, tp: int, who: str) -> int:
    """head_dim of a fused QKV projection with out_features rows, checked against the rule."""
    kv_heads = heads if kv_heads is None else kv_heads
    for what, n in (("heads", heads), ("kv_heads", kv_heads)):
        if type(n) is not int or n < 1:
            raise ValueError(f"{who}: colwise_qkv needs {what}= a positive int, got {n!r} "
                             f"(tensor-parallel size {tp})")
    per_group = heads // kv_heads + 2  # rows of head_dim per kv group: its q heads, k, v
    rule = (f"rows [kv group, (q x heads/kv_heads, k, v), head_dim] with heads={heads}, "
            f"kv_heads={kv_heads}; tensor-parallel size {tp}")
    if heads % kv_heads:
        raise ValueError(f"{who}: colwise_qkv: kv_heads {kv_heads} does not divide heads {heads}"
                         f" (tensor-parallel size {tp})")
    if out_features % (kv_heads * per_group):
        raise ValueError(f"{who}: colwise_qkv: out_features {out_features} is not "
                         f"kv_heads * (heads/kv_heads + 2) * head_dim = {kv_heads} * {per_group}"
                         f" * head_dim ({rule})")
    if kv_heads % tp:
        raise ValueError(f"{who}: colwise_qkv: kv_heads {kv_heads} is not divisible by the "
                         f"tensor-parallel size {tp}: a rank would get part of a kv group "
                         f"({rule})")
    return out_features // (kv_heads * per_group)


def _qkv(linear, group, heads=None, kv_heads=None, **options):
    _qkv_sizes(linear.out_features, heads, kv_heads, dist.get_world_size(group),
               f"nn.Linear({linear.in_features}, {linear.out_features})")
    return ColumnParallelLinear.from_linear(linear, group=group, **options)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             kv_heads: int | None = None) -> torch.Tensor:
    """The fused projection's weight (or bias) in the layout rule above, from separate q
    [heads*hd, ...], k and v [kv_heads*hd, ...] weights (or biases): rows [kv group, (q heads
    of the group, k, v), head_dim]."""
    kv_heads = heads if kv_heads is None else kv_heads
    hd = q.shape[0] // heads
    if q.shape[0] != heads * hd or k.shape != v.shape or k.shape[0] != kv_heads * hd or \
            heads % kv_heads or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"fuse_qkv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                         f" are not [heads*hd, ...], [kv_heads*hd, ...] x 2 with heads={heads},"
                         f" kv_heads={kv_heads}")
    rest = tuple(q.shape[1:])
    qg = q.reshape(kv_heads, heads // kv_heads * hd, *rest)
    kg, vg = (t.reshape(kv_heads, hd, *rest) for t in (k, v))
    return torch.cat([qg, kg, vg], 1).reshape(-1, *rest)


CONVERTERS: dict[tuple[str, type], Callable[..., nn.Module]] = {
    ("colwise", nn.Linear): lambda m, group, **o: ColumnParallelLinear.from_linear(
        m, group=group, **o),
    ("rowwise", nn.Linear): lambda m, group, **o: RowParallelLinear.from_linear(
        m, group=group, **o),
    ("colwise_sp", nn.Linear): lambda m, group, **o: ColumnParallelLinear.from_linear(
        m, group=group, sequence_parallel=True, **o),
    ("rowwise_sp", nn.Linear): lambda m, group, **o: RowParallelLinear.from_linear(
        m, group=group, sequence_parallel=True, **o),
    ("colwise_qkv", nn.Linear): _qkv,
    ("vocab", nn.Embedding): _vocab,
    # any module type (nn.Module: the fallback key): a norm, an embedding, a block
    ("sequence_norm", nn.Module): lambda m, group, **o: _sp("sequence_norm")(m, group, **o),
    ("sequence_scatter", nn.Module): lambda m, group, **o: _sp("sequence_scatter")(m, group, **o),
    ("sequence_gather", nn.Module): lambda m, group, **o: _sp("sequence_gather")(m, group, **o),
}
ALIASES = {"column": "colwise", "ColwiseParallel": "colwise",
           "row": "rowwise", "RowwiseParallel": "rowwise"}
SEQUENCE_PARALLEL = {"colwise_sp", "rowwise_sp", "sequence_norm", "sequence_scatter",
                     "sequence_gather"}


def _sp(name: str):
    from . import sequence_parallel  # imported when a plan asks for it
    return getattr(sequence_parallel, name)


def _converter(style: str, module: nn.Module):
    """CONVERTERS' entry for the module's type, or lora_tp's for a peft LoRA wrapper; None."""
    fn = CONVERTERS.get((style, type(module))) or CONVERTERS.get((style, nn.Module))
    if fn is None and "peft" in sys.modules:  # a peft wrapper exists only once peft is imported
        from .lora_tp import converter
        fn = converter(style, module, CONVERTERS)
    return fn


def _style(pattern: str, spec, tp: int) -> tuple[str, dict]:
    style, options = (spec, {}) if isinstance(spec, str) else spec
    style = ALIASES.get(style, style)
    if not any(s == style for s, _ in CONVERTERS):
        known = sorted({s for s, _ in CONVERTERS} | set(ALIASES))
        raise ValueError(f"parallelize: pattern {pattern!r} has style {style!r}; known styles: "
                         f"{', '.join(known)} (tensor-parallel size {tp})")
    return style, dict(options)


def _shared_parameters(modules: dict[str, nn.Module]) -> list[list[tuple[str, str]]]:
    """[(module name, attribute)] of each parameter that more than one module object holds."""
    owners: dict[int, list[tuple[str, str]]] = {}
    seen: set[int] = set()
    for name, m in modules.items():
        if id(m) in seen:
            continue
        seen.add(id(m))
        for attr, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((name, attr))
    return [o for o in owners.values() if len(o) > 1]


def _describe(name: str, chosen: dict) -> str:
    return f"{name!r} ({chosen[name][1]})" if name in chosen else f"{name!r} (not in the plan)"


def _check_ties(shared, chosen, tp: int) -> None:
    """Before converting: every module sharing a parameter with a converted one is converted."""
    for owners in shared:
        inside = [(n, a) for n, a in owners if n in chosen]
        outside = [(n, a) for n, a in owners if n not in chosen]
        if inside and outside:
            (n1, a1), (n2, a2) = inside[0], outside[0]
            raise ValueError(
                f"parallelize: {n1}.{a1} and {n2}.{a2} are one tied parameter, but only "
                f"{_describe(n1, chosen)} is sharded, {_describe(n2, chosen)} is not: that "
                f"would untie them. Shard both alike (e.g. 'vocab' for an embedding and "
                f"'colwise' for the LM head it is tied to) or neither "
                f"(tensor-parallel size {tp})")


def _tie(shared, chosen, new: dict[str, nn.Module], tp: int) -> None:
    """After converting: the converted modules of a shared parameter share one shard of it."""
    for owners in shared:
        if owners[0][0] not in chosen:
            continue
        (n1, a1), first = owners[0], getattr(new[owners[0][0]], owners[0][1], None)
        for n2, a2 in owners[1:]:
            other = getattr(new[n2], a2, None)
            same = (isinstance(first, nn.Parameter) and isinstance(other, nn.Parameter) and
                    first.shape == other.shape and first.dtype == other.dtype and
                    getattr(first, "partition_dim", None) == getattr(other, "partition_dim", None))
            if not same:
                shard = lambda p: (None if p is None else  # noqa: E731
                                   f"shape {tuple(p.shape)}, partition_dim "
                                   f"{getattr(p, 'partition_dim', None)}")
                raise ValueError(
                    f"parallelize: {n1}.{a1} and {n2}.{a2} are one tied parameter, but "
                    f"{_describe(n1, chosen)} and {_describe(n2, chosen)} shard it differently "
                    f"({shard(first)} vs {shard(other)}): they cannot stay tied. Use styles that "
                    f"keep the same slice (e.g. 'vocab' with 'colwise') "
                    f"(tensor-parallel size {tp})")
            setattr(new[n2], a2, first)


def parallelize(model: nn.Module, plan: dict, group=None, *, sequence_dim: int = 0,
                timeout=None) -> nn.Module:
    """Swap the modules `plan` names for their tensor-parallel versions over `group` (None:
    the default group), copying this rank's shard of their weights. Returns the model (the
    converted module itself if the plan names the root, ""). timeout (seconds or a timedelta):
    the converted modules run on one private group with it (a collective over the default
    group: every rank calls parallelize at the same point, as it must anyway)."""
    tp = dist.get_world_size(group)
    modules = dict(model.named_modules(remove_duplicate=False))
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
        if _converter(style, modules[n]) is None:
            can = ", ".join(t.__name__ for s, t in CONVERTERS if s == style)
            raise ValueError(f"parallelize: {n!r} (pattern {pattern!r}) is a "
                             f"{type(modules[n]).__name__}, which style {style!r} cannot shard "
                             f"(it shards {can}; tensor-parallel size {tp})")
    # one module object under several names: converted once, alike, and swapped in everywhere
    names: dict[int, list[str]] = {}
    for n, m in modules.items():
        names.setdefault(id(m), []).append(n)
    for n in list(chosen):
        for other in names[id(modules[n])]:
            if other not in chosen:
                chosen[other] = chosen[n]
            elif chosen[other][1:] != chosen[n][1:]:
                raise ValueError(f"parallelize: {n!r} and {other!r} are one module, matched "
                                 f"as {chosen[n][1]} and {chosen[other][1]} "
                                 f"(tensor-parallel size {tp})")
    first_name = {id(modules[n]): n for n in reversed(list(modules))}
    shared = _shared_parameters({n: modules[n] for n in first_name.values()})
    _check_ties(shared, {n: c for n, c in chosen.items() if first_name[id(modules[n])] == n}, tp)
    if timeout is not None:
        group = new_group_like(group, timeout)
    # convert everything before swapping anything: a failing entry leaves the model as it was
    made: dict[int, nn.Module] = {}
    for n, (_, style, options) in chosen.items():
        if id(modules[n]) not in made:
            try:
                made[id(modules[n])] = _converter(style, modules[n])(modules[n], group,
                                                                     **options)
            except ValueError as e:  # the converter's reason, with the module it was about
                raise ValueError(f"parallelize: {n!r} ({style}): {e}") from e
    new = {n: made[id(modules[n])] for n in chosen}
    _tie(shared, chosen, new, tp)
    breaker = Breaker(f"parallelize({type(model).__name__})'s tensor-parallel modules")
    for m in made.values():  # a LoRA wrapper's base and adapters too
        for sub in m.modules():
            if hasattr(sub, "breaker"):
                sub.breaker = breaker
    if "" in new:
        return new[""]
    for n, m in new.items():
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent), child, m)
    return model
