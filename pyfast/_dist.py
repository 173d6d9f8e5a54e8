"""torch.distributed's flat collectives under the name this torch has.

torch 2.13 calls them all_gather_single / reduce_scatter_single and deprecates the older
all_gather_into_tensor / reduce_scatter_tensor (FutureWarning); torch 2.11 (the CUDA build on the
lent H200, 2026-11-25) has only the older names, and every compressed collective failed there
with AttributeError. Looked up at each call, so a test that patches torch.distributed's
function sees the call."""
from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op=False):
    f = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return f(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    f = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return f(output, input, op=op, group=group, async_op=async_op)
