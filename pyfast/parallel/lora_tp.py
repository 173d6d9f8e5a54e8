"""Tensor parallelism of LoRA layers: a plan entry of parallelize() that matches peft's
`lora.Linear` wrapper (pyfast.models.lora) splits its base as the style says and its adapters
to match, as peft's Megatron layer does (peft/tuners/lora/tp_layer.py; Hu et al. 2021,
arXiv:2106.09685 for LoRA, Shoeybi et al. 2019, arXiv:1909.08053 for the split):

    column base (colwise, colwise_qkv, colwise_sp): weight rows split
        lora_A whole, h = A(dropout(x)) -> copy_to_tp_region (identity; all-reduce backward, so
        A's gradient is the whole one on every rank); lora_B's rows split as the base's rows
        (contiguous blocks: whole kv groups for colwise_qkv, like the base)
    row base (rowwise, rowwise_sp): weight columns split
        lora_A's columns split as the base's; h = reduce_from_tp_region(A(dropout(x))) (the
        partial products summed); lora_B whole; B(h) * scaling added to the base's summed output

Sequence parallelism: colwise_sp takes this rank's slice of the sequence, so A's output is
all-gathered along it (reduce-scattered back); rowwise_sp's output is this rank's slice, so A's
partial output is reduce-scattered. A replicated adapter that sees only this rank's tokens (A
of colwise_sp, B of rowwise_sp) takes its weight through copy_to_tp_region, whose backward sums
the ranks' partial gradients: the whole gradient on every rank, as for a sequence-parallel
bias (tensor._sp_linear_reduce_scatter).

The wrapper stays peft's (a shallow copy, so a failing plan leaves the model as it was): names
(`.base_layer.weight`, `.lora_A.default.weight`), scaling, merge (B shard @ A or B @ A shard is
the base shard's delta) and set_adapter keep working. Only lora_A / lora_B become AdapterLinear
and the base a Column/RowParallelLinear. Parameters are marked as tensor.py marks its own:
`tensor_parallel` True with the `partition_dim` of the whole [out, in] weight for a shard, False
for a replicated adapter (so the job counts it once in the gradient norm).

A QuantLinear base (pyfast.models.quant_base; parallel/ does not import models, so it is known
by its `codes` / `fmt`): "bf16" (the weight itself, cast) is split exactly as an nn.Linear is;
int8 and nf4 are refused (their blockwise codes are laid out over the whole flattened weight:
a row split would cut blocks, and a shard re-quantized from the whole would differ from it).

Dropout: A's input is whole on every rank of a column layer, so lora dropout > 0 needs the same
random state on the tp ranks (the job seeds every rank alike); a row layer drops its own slice.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from pyfast.comm.failure import Breaker

from .tensor import ColumnParallelLinear, RowParallelLinear
from .tp_comm import (CommGuard, copy_to_tp_region, gather_from_sequence_parallel_region,
                      gather_from_tp_region, reduce_from_tp_region,
                      reduce_scatter_to_sequence_parallel_region, scatter_to_tp_region, tp_world)

# style -> (split of the base weight: 0 rows / 1 columns, sequence parallel)
STYLES = {"colwise": (0, False), "colwise_qkv": (0, False), "colwise_sp": (0, True),
          "rowwise": (1, False), "rowwise_sp": (1, True)}


def _a_column(m, x):
    return copy_to_tp_region(F.linear(x, m.weight), m.group, m.guard)


def _a_column_sp(m, x):
    w = copy_to_tp_region(m.weight, m.group, m.guard)
    return gather_from_sequence_parallel_region(F.linear(x, w), m.group, m.sequence_dim, m.guard)


def _a_row(m, x):
    if m.scatter_input:  # a row base with input_is_parallel=False takes the whole input
        x = scatter_to_tp_region(x, m.group, -1, m.guard)
    return reduce_from_tp_region(F.linear(x, m.weight), m.group, m.guard)


def _a_row_sp(m, x):
    return reduce_scatter_to_sequence_parallel_region(F.linear(x, m.weight), m.group,
                                                      m.sequence_dim, m.guard)


def _b_column(m, x):
    y = F.linear(x, m.weight)
    return gather_from_tp_region(y, m.group, -1, m.guard) if m.gather_output else y


def _b_row(m, x):
    return F.linear(x, m.weight)


def _b_row_sp(m, x):
    return F.linear(x, copy_to_tp_region(m.weight, m.group, m.guard))


# (column?, sequence parallel?) -> forward of lora_A, of lora_B
FORWARDS = {(True, False): (_a_column, _b_column), (True, True): (_a_column_sp, _b_column),
            (False, False): (_a_row, _b_row), (False, True): (_a_row_sp, _b_row_sp)}


class AdapterLinear(nn.Module):
    """One adapter matrix (lora_A or lora_B, no bias) of a tensor-parallel LoRA layer: its
    weight this rank's shard (partition_dim) or whole (None), and `fn`, the GEMM with the
    collective its place in the layer needs (module docstring). peft reads `.weight`."""

    def __init__(self, linear: nn.Linear, fn, group, partition_dim, sequence_dim: int,
                 breaker: Breaker, scatter_input: bool = False, gather_output: bool = False):
        super().__init__()
        self.fn, self.group, self.partition_dim = fn, group, partition_dim
        self.tp_size, tp_rank = tp_world(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.sequence_dim, self.breaker = sequence_dim, breaker
        self.scatter_input, self.gather_output = scatter_input, gather_output
        w = linear.weight.detach()
        if partition_dim is not None:
            w = w.chunk(self.tp_size, partition_dim)[tp_rank]
        self.weight = nn.Parameter(w.clone(), requires_grad=linear.weight.requires_grad)
        self.weight.tensor_parallel = partition_dim is not None
        self.weight.partition_dim = partition_dim

    @property
    def guard(self) -> CommGuard:
        return CommGuard(f"LoRA {self._name()}", self.breaker)

    def _name(self) -> str:
        return f"{type(self).__name__}(in_features={self.in_features}, " \
               f"out_features={self.out_features})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.breaker.check()
        return self.fn(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"tp={self.tp_size}, partition_dim={self.partition_dim}, {self.fn.__name__[1:]}"


class _QuantShard:
    """A frozen QuantLinear base ("bf16": `codes` is the weight cast) split as its Column /
    RowParallelLinear parent splits an nn.Linear; `weight` is the shard dequantized to fp32 (the
    parent's forward casts it under autocast, as QuantLinear dequantizes into the autocast
    dtype: the same values, bf16 -> fp32 -> bf16 being exact).

    The parent's __init__ builds (and marks) a meta `weight` Parameter, which from_quant then
    deletes: until `codes` exists, the `weight` property raises AttributeError and Python falls
    back to nn.Module.__getattr__, which finds that meta Parameter."""

    @classmethod
    def from_quant(cls, q, group, **options):
        m = cls(q.in_features, q.out_features, bias=q.bias is not None, group=group,
                device="meta", **options)  # the parent's checks and options, no init drawn
        del m.weight  # held as `codes`, as QuantLinear holds it
        dim = cls.partition_dim
        m.fmt, m.block = q.fmt, q.block
        codes = q.codes.view(q.shape).chunk(m.tp_size, dim)[m.tp_rank].clone()
        m.shape = tuple(codes.shape)
        m.codes = nn.Parameter(codes, requires_grad=False)
        m.scales = nn.Parameter(q.scales.detach().clone(), requires_grad=False)  # empty: bf16
        if q.bias is not None:
            b = q.bias.detach()
            m.bias = nn.Parameter((b.chunk(m.tp_size)[m.tp_rank] if dim == 0 else b).clone(),
                                  requires_grad=False)
        m._mark()
        return m

    @property
    def weight(self) -> torch.Tensor:
        w = self.codes.to(torch.float32)
        w.tensor_parallel, w.partition_dim = True, self.partition_dim  # what readers check
        return w

    def _mark(self):
        if "codes" not in self._parameters:  # the parent's __init__, on its meta weight
            return super()._mark()
        self.codes.tensor_parallel, self.codes.partition_dim = True, self.partition_dim
        self.scales.tensor_parallel, self.scales.partition_dim = False, None
        if self.bias is not None:
            sharded = self.partition_dim == 0
            self.bias.tensor_parallel, self.bias.partition_dim = sharded, 0 if sharded else None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fmt={self.fmt}"


class QuantColumnParallelLinear(_QuantShard, ColumnParallelLinear):
    pass


class QuantRowParallelLinear(_QuantShard, RowParallelLinear):
    pass


def _quant_base(q, style: str, group, base_convert, options: dict) -> nn.Module:
    if q.fmt != "bf16":
        raise ValueError(f"its base is a QuantLinear stored {q.fmt}, which tensor parallelism "
                         f"cannot split yet: the blockwise {q.fmt} codes run over the whole "
                         f"flattened weight, so a shard is not a slice of them (and one "
                         f"re-quantized from it would differ); use --base-dtype bf16 or "
                         f"--tp 1 (tensor-parallel size {tp_world(group)[0]})")
    # the nn.Linear converter's checks (sizes, colwise_qkv's layout), on a meta layer
    base_convert(nn.Linear(q.in_features, q.out_features, bias=q.bias is not None,
                           device="meta"), group, **options)
    column, sp = STYLES[style][0] == 0, STYLES[style][1]
    options = {k: v for k, v in options.items() if k not in ("heads", "kv_heads")}
    cls = QuantColumnParallelLinear if column else QuantRowParallelLinear
    return cls.from_quant(q, group, **({"sequence_parallel": True} if sp else {}), **options)


def convert(layer: LoraLinear, style: str, group, base_convert, **options) -> LoraLinear:
    """A copy of peft's lora.Linear `layer` with its base converted by `base_convert` (the
    style's nn.Linear converter, with `options`) and its adapters split to match."""
    tp = tp_world(group)[0]
    if getattr(layer, "lora_variant", None) or any(getattr(layer, "use_dora", {}).values()):
        raise ValueError(f"a LoRA variant (DoRA, ...) under tensor parallelism is not "
                         f"supported, only plain LoRA (tensor-parallel size {tp})")
    if getattr(layer, "lora_bias", None) and any(layer.lora_bias.values()):
        raise ValueError(f"LoRA with lora_bias under tensor parallelism is not supported "
                         f"(tensor-parallel size {tp})")
    base = layer.base_layer
    if type(base) is nn.Linear:
        new_base = base_convert(base, group, **options)
    elif hasattr(base, "codes") and hasattr(base, "fmt"):
        new_base = _quant_base(base, style, group, base_convert, options)
    else:
        raise ValueError(f"its base layer is a {type(base).__name__}; a LoRA layer is split "
                         f"over an nn.Linear or a bf16 QuantLinear base (tensor-parallel size "
                         f"{tp})")
    column = isinstance(new_base, ColumnParallelLinear)
    fn_a, fn_b = FORWARDS[column, new_base.sequence_parallel]
    kw = dict(group=group, sequence_dim=new_base.sequence_dim, breaker=new_base.breaker)
    new = copy.copy(layer)  # peft's state (scaling, r, active adapters) shared; modules not
    new._modules, new._parameters = dict(layer._modules), dict(layer._parameters)
    new._buffers = dict(layer._buffers)
    new.base_layer = new_base
    new.lora_A = nn.ModuleDict({
        k: AdapterLinear(a, fn_a, partition_dim=None if column else 1,
                         scatter_input=not column and not new_base.input_is_parallel, **kw)
        for k, a in layer.lora_A.items()})
    new.lora_B = nn.ModuleDict({
        k: AdapterLinear(b, fn_b, partition_dim=0 if column else None,
                         gather_output=column and new_base.gather_output, **kw)
        for k, b in layer.lora_B.items()})
    return new


def converter(style: str, module: nn.Module, converters: dict):
    """parallelize's converter for `module` in `style` if it is a peft lora.Linear whose style
    splits a Linear, else None."""
    if type(module) is not LoraLinear or style not in STYLES:
        return None
    base_convert = converters[style, nn.Linear]
    return lambda m, group, **o: convert(m, style, group, base_convert, **o)


__all__ = ["AdapterLinear", "QuantColumnParallelLinear", "QuantRowParallelLinear", "convert",
           "converter"]
