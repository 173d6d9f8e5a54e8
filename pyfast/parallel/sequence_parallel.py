"""Sequence parallelism's module styles for parallelize(): the regions between the TP matmuls.

Korthikanti et al. 2022 (arXiv:2205.05198, section 4.2.2): with sequence parallelism the
activations outside the column/row pairs (layer norms, residual adds) are sharded along the
sequence over the tp group, so each rank stores and computes 1/tp of them. The column layer
all-gathers its input and the row layer reduce-scatters its output (tensor.py's colwise_sp /
rowwise_sp); what is left is done here, by module, keeping each module's type and names
(checkpoint keys do not change):

    sequence_norm     any module with replicated parameters run on a sequence shard (LayerNorm,
                      RMSNorm): each rank's gradient of them covers its tokens only, so it is
                      all-reduced (summed) over tp in backward, as Megatron all-reduces the
                      grads of parameters marked `sequence_parallel` before the optimizer step.
                      The parameters get `sequence_parallel = True`.
    sequence_scatter  the module's output (whole on every rank, e.g. the embedding's) is cut to
                      this rank's slice of the sequence; backward all-gathers the slices.
    sequence_gather   the module's output (a sequence shard, e.g. the last block's) is
                      all-gathered, whole on every rank, for a head that runs replicated;
                      backward keeps this rank's slice (every rank computes the same loss, so
                      the gradients of the whole tensor are equal: nothing to sum).

The all-reduce of a norm's gradient runs in a tensor hook (before the gradient is accumulated,
so DataParallel's post-accumulate hooks read the summed one): one small all-reduce per
parameter per backward (4 per GPT block), where Megatron coalesces them into one per step.
On gloo here it is a few hundred bytes a call; on NCCL each is a launch (~10-20 us).
"""
from __future__ import annotations

from torch import nn

from .tp_comm import _all_reduce, gather_from_tp_region, scatter_to_sequence_parallel_region


def sequence_norm(module: nn.Module, group, sequence_dim: int = 1) -> nn.Module:
    """Mark the module's own trainable parameters sequence-parallel and sum their gradients
    over `group` in backward. In place; returns the module."""
    for p in module.parameters(recurse=False):
        if not p.requires_grad or getattr(p, "sequence_parallel", False):
            continue
        p.sequence_parallel = True
        p.register_hook(lambda g: _all_reduce(
            g, group, op="backward all-reduce (sequence_norm: a sequence-sharded norm's "
                         "parameter gradient)"))
    return module


def sequence_scatter(module: nn.Module, group, sequence_dim: int = 1) -> nn.Module:
    """Cut the module's output to this rank's slice of dimension `sequence_dim`. In place."""
    module.register_forward_hook(
        lambda m, args, out: scatter_to_sequence_parallel_region(out, group, sequence_dim))
    return module


def sequence_gather(module: nn.Module, group, sequence_dim: int = 1) -> nn.Module:
    """All-gather the module's output along `sequence_dim` (backward: this rank's slice)."""
    module.register_forward_hook(
        lambda m, args, out: gather_from_tp_region(out, group, sequence_dim))
    return module
