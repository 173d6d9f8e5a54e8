"""Tensor-parallel linear layers: Megatron-LM's ColumnParallelLinear and RowParallelLinear
(Shoeybi et al. 2019, arXiv:1909.08053, section 3), with optional sequence parallelism
(Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2).

Both return a plain tensor (Megatron returns (output, bias)), so they drop in for nn.Linear:
`ColumnParallelLinear.from_linear(model.fc1)` shards an existing layer and computes what it did.

    column: weight [out/tp, in]   x -> copy_to_tp_region -> F.linear -> (gather last dim)
    row:    weight [out, in/tp]   (scatter last dim) -> F.linear -> reduce_from_tp_region + bias

With sequence_parallel=True the input of a column layer and the output of a row layer are
sharded along `sequence_dim`: the copy becomes an all-gather and the all-reduce a
reduce-scatter (`_sp_gather_linear` / `_sp_linear_reduce_scatter`); `overlap=True` (or a
number of pieces) runs them through pyfast.parallel.async_tp, which overlaps that collective
with the GEMM piece by piece, with the same bits.

Parameters say how they are split, so optimizers and checkpointing can tell: every weight and
bias has `tensor_parallel` (True: this rank holds a shard) and `partition_dim` (the dimension
of the full tensor it is a slice of; None when whole).

Autocast: the layer computes what nn.Linear computes under it (x, weight and bias cast to the
autocast dtype, the GEMM, the collectives and the bias add in it), on every backend; the GEMM
is pyfast's Triton kernel on CUDA where its dtype rules hold, else torch's (ops.gemm_backend).

Failures: `timeout=` (seconds or a timedelta) runs the layer on a private process group with
that timeout (made collectively at construction, pyfast.comm.failure.new_group_like), so a
silent peer fails a step instead of hanging for the group's 30 minutes. A failed collective, in
forward or backward, raises CommError naming the layer and the operation, and breaks the layer
(`breaker`, shared by all layers parallelize converts): later steps raise at once instead of
pairing their collectives with a peer's different ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyfast.comm.failure import Breaker, new_group_like
from pyfast.ops.linear import autocast_linear_args, gemm_backend, linear_act

from .async_tp import all_gather_linear, linear_reduce_scatter
from torch.autograd import Function

from .tp_comm import (CommGuard, _gather, _reduce_scatter, copy_to_tp_region,
                      gather_from_tp_region, reduce_from_tp_region,
                      reduce_scatter_to_sequence_parallel_region, scatter_to_tp_region, tp_world)


# overlap=True: 4 pieces per shard, the most hidden at 1 Gbit/s in bench/results/overlap_tp.txt
# (1024^3 fp32, 2 ranks: c=1 33%, c=2 50%, c=4 62%, c=8 60%). Below OVERLAP_MIN_BYTES on the
# wire per call the plain path runs instead: the small block of bench/results/tp.txt (256 tokens,
# h 256: 128-512 KB a call) took 18.8 ms a step overlapped vs 12.1 plain on loopback, the fixed
# cost of the pieces (p2p posts, shape headers) exceeding their whole transfer; the big block
# (4-16 MB a call) gained 1.5x on 1 Gbit/s. Ranks see the same shapes, so they decide alike.
OVERLAP_PIECES = 4
OVERLAP_CHUNKS = OVERLAP_PIECES  # the old name (tests import it)
OVERLAP_MIN_BYTES = 1 << 20


def _linear(x, weight, bias=None):
    """The local GEMM (autocast already resolved): pyfast's Triton matmul with the fused bias
    epilogue on CUDA where its dtypes hold; else torch's F.linear (cuBLAS; MKL on CPU, which a
    fused C++ epilogue did not beat, pyfast/ops/linear.py)."""
    b_dtype = bias.dtype if bias is not None else None
    if gemm_backend(x.device, x.dtype, weight.dtype, b_dtype) == "triton":
        return linear_act(x, weight, bias)
    return F.linear(x, weight, bias)


class _GatherLinear(Function):
    """all_gather(x) @ weight.T + bias that saves only this rank's shard of x for backward and
    all-gathers it again there (Korthikanti et al. 2022, section 4.2.2: what makes sequence
    parallelism store the norms' outputs once over tp). gather_from_sequence_parallel_region
    followed by F.linear would save the gathered input: tp x the bytes (gpt-small, tp 2, seq
    256: the dry run's activations 74.4 MiB a rank that way vs 105.2 without SP at all)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim, guard):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dim, ctx.guard, ctx.bias = group, dim, guard, bias is not None
        full = _gather(x, dim, group, guard, "forward all-gather (sequence-parallel column)")
        return _linear(full, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = _reduce_scatter(g.matmul(weight), ctx.dim, ctx.group, ctx.guard,
                             "backward reduce-scatter (sequence-parallel column)") \
            if ctx.needs_input_grad[0] else None
        gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:  # a frozen base (LoRA) needs none
            full = _gather(x, ctx.dim, ctx.group, ctx.guard,
                           "backward all-gather (sequence-parallel column, the saved shard)")
            gw = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None, None, None


def _sp_gather_linear(x, weight, bias, group, dim: int, pieces: int = 0, guard=None):
    """All-gather x along the sequence dimension `dim`, then x @ weight.T + bias (column
    layer, sequence parallel). Backward: the input gradient is reduce-scattered along `dim`.
    pieces > 0: the gather overlapped with the GEMM (async_tp), bitwise the same result;
    else _GatherLinear (only the shard saved). gather_from_sequence_parallel_region + F.linear
    stays the reference (tests/test_tensor_parallel.py)."""
    if pieces:
        return all_gather_linear(x, weight, bias, group, dim, pieces, guard=guard)
    if tp_world(group)[0] == 1:
        return _linear(x, weight, bias)
    return _GatherLinear.apply(x, weight, bias, group, dim, guard)


def _sp_linear_reduce_scatter(x, weight, bias, group, dim: int, pieces: int = 0, guard=None):
    """x @ weight.T (a partial sum over this rank's input features), reduce-scattered along
    the sequence dimension `dim`, plus bias (row layer, sequence parallel).

    The bias is added once, after the sum, to this rank's slice of the sequence, so its
    gradient here covers that slice only: copy_to_tp_region all-reduces it in backward, and
    every rank ends with the whole bias gradient, as without sequence parallelism."""
    if pieces:
        y = linear_reduce_scatter(x, weight, None, group, dim, pieces, guard=guard)
    else:
        y = reduce_scatter_to_sequence_parallel_region(_linear(x, weight), group, dim, guard)
    return y if bias is None else y + copy_to_tp_region(bias, group, guard)


class _ParallelLinear(nn.Module):
    """What both layers share: the shard, its init, from_linear, checks and repr."""

    partition_dim: int  # of the full [out, in] weight: 0 column, 1 row

    def __init__(self, in_features: int, out_features: int, bias: bool, group,
                 sequence_parallel: bool, sequence_dim: int, device=None, dtype=None,
                 overlap: int = 0, timeout=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # timeout: a private group like `group` with it (a collective: every rank builds the
        # layer at the same point, as it must anyway to shard it)
        self.group = new_group_like(group, timeout) if timeout is not None else group
        self.breaker = Breaker(self._name())
        self.tp_size, self.tp_rank = tp_world(self.group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        if overlap and not sequence_parallel:
            raise ValueError(f"{self._name()}: overlap={overlap} needs sequence_parallel=True "
                             "(it overlaps the sequence all-gather / reduce-scatter with the "
                             f"GEMM; tensor-parallel size {self.tp_size})")
        if type(overlap) not in (bool, int) or overlap < 0:
            raise ValueError(f"{self._name()}: overlap must be a bool or a number of pieces "
                             f">= 0, got {overlap!r} (tensor-parallel size {self.tp_size})")
        self.pieces = OVERLAP_PIECES if overlap is True else int(overlap)
        self.overlap_auto = overlap is True  # False: an explicit count always runs overlapped
        split = (out_features, in_features)[self.partition_dim]
        if split % self.tp_size:
            which = ("out_features", "in_features")[self.partition_dim]
            raise ValueError(f"{self._name()}: {which} {split} (weight shape "
                             f"{(out_features, in_features)}) is not divisible by the "
                             f"tensor-parallel size {self.tp_size}")
        shape = [out_features, in_features]
        shape[self.partition_dim] //= self.tp_size
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        bias_len = shape[0] if self.partition_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_len, **kw)) if bias else None
        self._mark()
        self.reset_parameters()

    def _name(self) -> str:
        return (f"{type(self).__name__}(in_features={self.in_features}, "
                f"out_features={self.out_features})")

    @property
    def guard(self) -> CommGuard:
        """Names this layer in a failed collective's error and breaks `breaker`."""
        return CommGuard(self._name(), self.breaker)

    def _mark(self):
        self.weight.tensor_parallel, self.weight.partition_dim = True, self.partition_dim
        if self.bias is not None:
            sharded = self.partition_dim == 0
            self.bias.tensor_parallel, self.bias.partition_dim = sharded, 0 if sharded else None

    def reset_parameters(self):
        # Every rank draws the FULL layer exactly as nn.Linear does (kaiming_uniform(a=sqrt(5))
        # weight and uniform(+-1/sqrt(in_features)) bias, from torch's default generator) and
        # keeps its slice. So the sharded layer is the nn.Linear that seed gives, whatever the
        # TP size (a tp=2 and a tp=4 run start from the same model); fan_in is the full
        # layer's (a row shard's own fan_in, in/tp, would give a bound sqrt(tp) too wide); and
        # no communication is needed, only the same seed on every rank, as data-parallel
        # replicas already need. The cost is one transient full matrix per rank.
        if self.weight.is_meta:
            return
        full = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         device=self.weight.device, dtype=self.weight.dtype)
        self._copy_shards(full)

    @torch.no_grad()
    def _copy_shards(self, linear: nn.Linear):
        self.weight.copy_(linear.weight.chunk(self.tp_size, self.partition_dim)[self.tp_rank])
        if self.bias is not None:
            b = linear.bias
            self.bias.copy_(b.chunk(self.tp_size)[self.tp_rank] if self.partition_dim == 0 else b)

    @classmethod
    def _from_linear(cls, linear: nn.Linear, **kwargs):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear needs an nn.Linear, got "
                            f"{type(linear).__name__}")
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                device="meta", dtype=w.dtype, **kwargs)  # meta: no init drawn, then thrown away
        m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=w.dtype, device=w.device),
                                requires_grad=w.requires_grad)
        if m.bias is not None:
            m.bias = nn.Parameter(torch.empty(m.bias.shape, dtype=w.dtype, device=w.device),
                                  requires_grad=linear.bias.requires_grad)
        m._mark()
        m._copy_shards(linear)
        return m

    def _check_input(self, x: torch.Tensor, features: int, what: str):
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(f"{self._name()}: input of shape {tuple(x.shape)} has last "
                             f"dimension {x.shape[-1] if x.dim() else None}, expected "
                             f"{features} ({what}; tensor-parallel size {self.tp_size})")

    def _pieces(self, wire_bytes: int) -> int:
        """async_tp pieces for a call moving about wire_bytes per rank (0: the plain path)."""
        if self.overlap_auto and wire_bytes < OVERLAP_MIN_BYTES:
            return 0
        return self.pieces

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, "
             f"tp={self.tp_size}, bias={self.bias is not None}")
        if self.sequence_parallel:
            s += f", sequence_parallel=True, sequence_dim={self.sequence_dim}"
        if self.pieces:
            s += f", overlap={self.pieces}"
        return s


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split by rows (output features) across the TP group: this rank
    holds weight [out/tp, in] and bias [out/tp] and returns its slice of the output features,
    or the whole output if gather_output. Megatron's `f` (copy forward, all-reduce backward) is
    applied to the input, or with sequence_parallel an all-gather along `sequence_dim` (the
    input is then this rank's slice of the sequence)."""

    partition_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group=None, sequence_parallel: bool = False,
                 sequence_dim: int = 0, device=None, dtype=None, overlap: int = 0,
                 timeout=None):
        super().__init__(in_features, out_features, bias, group, sequence_parallel,
                         sequence_dim, device, dtype, overlap, timeout)
        self.gather_output = gather_output

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False, group=None,
                    sequence_parallel: bool = False, sequence_dim: int = 0, overlap: int = 0,
                    timeout=None):
        """This rank's shard of `linear` (its rows), same dtype and device."""
        return cls._from_linear(linear, gather_output=gather_output, group=group,
                                sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                                overlap=overlap, timeout=timeout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.breaker.check()
        self._check_input(x, self.in_features, "in_features")
        guard = self.guard
        (x, w, b), no_autocast = autocast_linear_args(x, self.weight, self.bias)
        with no_autocast:
            if self.sequence_parallel:
                y = _sp_gather_linear(x, w, b, self.group, self.sequence_dim,
                                      self._pieces(x.numel() * x.element_size()), guard)
            else:
                y = _linear(copy_to_tp_region(x, self.group, guard), w, b)
            return gather_from_tp_region(y, self.group, -1, guard) if self.gather_output else y

    def extra_repr(self) -> str:
        return super().extra_repr() + (", gather_output=True" if self.gather_output else "")


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split by columns (input features) across the TP group: this rank
    holds weight [out, in/tp] and the whole bias [out]. Its input is this rank's slice of the
    input features (input_is_parallel, what a ColumnParallelLinear without gather_output
    returns), or the whole input, which is then scattered. The partial products are summed by
    Megatron's `g` (all-reduce forward, identity backward), or with sequence_parallel
    reduce-scattered along `sequence_dim`; the bias is added once, after the sum."""

    partition_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, group=None, sequence_parallel: bool = False,
                 sequence_dim: int = 0, device=None, dtype=None, overlap: int = 0,
                 timeout=None):
        super().__init__(in_features, out_features, bias, group, sequence_parallel,
                         sequence_dim, device, dtype, overlap, timeout)
        self.input_is_parallel = input_is_parallel
        if sequence_parallel and not input_is_parallel:  # as Megatron: SP follows a column layer
            raise ValueError(f"{self._name()}: sequence_parallel needs input_is_parallel=True "
                             f"(tensor-parallel size {self.tp_size})")

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = True, group=None,
                    sequence_parallel: bool = False, sequence_dim: int = 0, overlap: int = 0,
                    timeout=None):
        """This rank's shard of `linear` (its columns; the whole bias), same dtype and device."""
        return cls._from_linear(linear, input_is_parallel=input_is_parallel, group=group,
                                sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                                overlap=overlap, timeout=timeout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.breaker.check()
        (x, w, b), no_autocast = autocast_linear_args(x, self.weight, self.bias)
        with no_autocast:
            return self._forward(x, w, b, self.guard)

    def _forward(self, x, w, b, guard):
        if self.input_is_parallel:
            self._check_input(x, self.in_features // self.tp_size, "in_features / tp, "
                              "input_is_parallel")
        else:
            self._check_input(x, self.in_features, "in_features")
            x = scatter_to_tp_region(x, self.group, -1, guard)
        if self.sequence_parallel:
            if x.shape[self.sequence_dim] % self.tp_size:
                raise ValueError(f"{self._name()}: input of shape {tuple(x.shape)}: sequence "
                                 f"dimension {self.sequence_dim} is not divisible by the "
                                 f"tensor-parallel size {self.tp_size}")
            wire = x.numel() // x.shape[-1] * self.out_features * x.element_size()
            return _sp_linear_reduce_scatter(x, w, b, self.group, self.sequence_dim,
                                             self._pieces(wire), guard)
        y = reduce_from_tp_region(_linear(x, w), self.group, guard)
        return y if b is None else y + b

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.input_is_parallel else
                                       ", input_is_parallel=False")
