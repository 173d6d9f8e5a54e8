"""Tensor-parallel primitives at 2 and 4 gloo ranks against a single-process reference.

Every rank builds the same global tensors from one seed, so the reference of each primitive is
computed in-process (slice, sum, concatenate). Gathers, scatters and slices move bits: compared
exactly. Sums run in gloo's order, not ours: compared with rtol 1e-6 (a 4-term fp32 sum in
another order differs by a few ulps, about 2.4e-7 relative each).
"""
import pytest
import torch

from dist_utils import run_ranks

SHAPE = (8, 3, 12)  # dims 0 and 2 split over 2 and 4 ranks; dim 1 odd (never split)


def _globals(world):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(SHAPE, generator=g) for _ in range(world)]  # per-rank inputs of sums
    gy = torch.randn(SHAPE, generator=g)  # an upstream gradient
    return xs, gy


def _worker(rank, world):
    import torch.distributed as dist

    from pyfast.parallel import tp_comm
    xs, gy = _globals(world)
    out = {}

    def run(fn, x, g):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(g if g.shape == y.shape else g[tuple(slice(0, s) for s in y.shape)])
        return y.detach(), x.grad

    out["copy"] = run(lambda x: tp_comm.copy_to_tp_region(x), xs[rank], xs[rank] * 2)
    out["reduce"] = run(lambda x: tp_comm.reduce_from_tp_region(x), xs[rank], gy)
    out["scatter"] = run(lambda x: tp_comm.scatter_to_tp_region(x, dim=-1), xs[0],
                         xs[rank].chunk(world, -1)[rank])
    out["gather"] = run(
        lambda x: tp_comm.gather_from_tp_region(x.chunk(world, -1)[rank] * 1, dim=-1), xs[0], gy)
    for d in (0, 2):
        out[f"sp_gather{d}"] = run(
            lambda x: tp_comm.gather_from_sequence_parallel_region(x.chunk(world, d)[rank] * 1,
                                                                   dim=d),
            xs[0], xs[rank])
        out[f"sp_rs{d}"] = run(
            lambda x: tp_comm.reduce_scatter_to_sequence_parallel_region(x, dim=d), xs[rank],
            gy.chunk(world, d)[rank].contiguous())
    try:
        tp_comm.scatter_to_tp_region(torch.randn(3, 5), dim=-1)
    except ValueError as e:
        out["err"] = str(e)
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_primitives_match_reference(world):
    res = run_ranks(_worker, world)
    xs, gy = _globals(world)
    total = sum(xs[1:], xs[0].clone())
    tol = dict(rtol=1e-6, atol=1e-6)
    for r, o in enumerate(res):
        y, g = o["copy"]  # identity forward; backward sums every rank's gradient (2 x_r)
        assert torch.equal(y, xs[r])
        torch.testing.assert_close(g, 2 * total, **tol)
        y, g = o["reduce"]
        torch.testing.assert_close(y, total, **tol)
        assert torch.equal(g, gy)
        y, g = o["scatter"]  # own slice forward; gradient is every rank's slice, gathered
        assert torch.equal(y, xs[0].chunk(world, -1)[r])
        assert torch.equal(g, torch.cat([xs[q].chunk(world, -1)[q] for q in range(world)], -1))
        y, g = o["gather"]
        assert torch.equal(y, xs[0])
        expect = torch.zeros(SHAPE)
        expect.chunk(world, -1)[r].copy_(gy.chunk(world, -1)[r])
        assert torch.equal(g, expect)
        for d in (0, 2):
            y, g = o[f"sp_gather{d}"]  # gather along d; gradient reduce-scattered along d
            assert torch.equal(y, xs[0])
            expect = torch.zeros(SHAPE)
            expect.chunk(world, d)[r].copy_(total.chunk(world, d)[r])
            torch.testing.assert_close(g, expect, **tol)
            y, g = o[f"sp_rs{d}"]
            torch.testing.assert_close(y, total.chunk(world, d)[r], **tol)
            assert torch.equal(g, torch.cat([gy.chunk(world, d)[q] for q in range(world)], d))
        assert "not divisible by the tensor-parallel size" in o["err"] and "(3, 5)" in o["err"]
        # ranks agree bit for bit on every summed result
        assert torch.equal(o["reduce"][0], res[0]["reduce"][0])
