"""GPU-ready zero(): every buffer its stages allocate (unit buffers, master shards, the side band
of used flags, stage 3's gathered parameters, the all-gather segments) follows the parameters'
device. The ranks run with torch.set_default_device("meta") while the module and the data are
made on the CPU explicitly: a buffer made without a device becomes a meta tensor, which gloo
cannot send and CPU arithmetic refuses to mix with, so the step fails. The parameters after two
AdamW steps must also equal those of the same run without the meta default (bitwise: the same
arithmetic on the same device), and the replicas must be identical across ranks.
"""
import pytest
import torch
from torch import nn

from dist_utils import run_ranks

CASES = [(1, None, None), (2, None, None), (2, "int8", None), (3, None, None),
         (3, "int8", "int8")]


class Net(nn.Module):
    """Ragged sizes (a LayerNorm of 37, biases) in a ModuleList: stage 3 gets two units."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(13, 37), nn.LayerNorm(37)),
                                     nn.Sequential(nn.GELU(), nn.Linear(37, 3))])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _steps(rank, world):
    from pyfast.parallel import zero
    cpu = torch.device("cpu")  # explicit, as a user's CUDA tensors would be
    out = {}
    for meta in (False, True):
        for stage, grads, params in CASES:
            key = (meta, stage, grads, params)
            torch.set_default_device("meta" if meta else None)
            try:
                with torch.device(cpu):
                    torch.manual_seed(0)
                    m = Net()
                    g = torch.Generator(device=cpu).manual_seed(rank)
                    xs = [(torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g))
                          for _ in range(2)]
                model, opt = zero(m, torch.optim.AdamW, stage=stage, compressor=grads,
                                  param_compressor=params, lr=1e-2)
                for x, y in xs:
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                # the updated values: stage 1/2 the replicas, stage 3 the master shards
                got = torch.cat([s.reshape(-1) for s in opt.shards.values()] if stage == 3 else
                                [p.detach().reshape(-1) for p in m.parameters()])
                assert got.device == cpu, got.device
                out[key] = got.clone()
                model.close()
            except Exception as e:  # reported all at once by the test, with where it failed
                import traceback
                frames = [f for f in traceback.extract_tb((e.__cause__ or e).__traceback__)
                          if "/pyfast/" in f.filename]
                where = f"{frames[-1].filename.split('/pyfast/')[-1]}:{frames[-1].lineno}" \
                    if frames else "?"
                out[key] = f"{type(e).__name__} at {where}: {e}"
            finally:
                torch.set_default_device(None)
    return out


@pytest.mark.parametrize("world", [2])
def test_zero_buffers_follow_the_parameters_device(world):
    out = run_ranks(_steps, world, timeout=180)
    bad = {k: v for o in out for k, v in o.items() if isinstance(v, str)}
    assert not bad, bad
    for stage, grads, params in CASES:
        for r in range(world):
            a, b = out[r][True, stage, grads, params], out[r][False, stage, grads, params]
            assert torch.equal(a, b), (stage, grads, params, r)
        if stage < 3:  # replicas: the same bytes on every rank
            assert torch.equal(out[0][False, stage, grads, params],
                               out[1][False, stage, grads, params]), (stage, grads, params)


def _saved_storages(rank, world):
    """Stage 3, bytes of parameter-sized storage that autograd's saved tensors still hold after
    a grad forward (before backward), against one unit's parameter bytes."""
    from pyfast.parallel import zero
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 96), nn.GELU()) if i % 2 == 0 else
                        nn.Sequential(nn.Linear(96, 64), nn.GELU()) for i in range(6)])
    model, opt = zero(m, torch.optim.AdamW, stage=3, lr=1e-2)
    saved = []
    x = torch.randn(4, 64)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    weight_bytes = 64 * 96 * 4
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
            if t.untyped_storage().nbytes() >= weight_bytes}
    out.sum().backward()  # the freed storages are refilled for backward: it must still work
    opt.step()
    model.close()
    return sum(held.values()), weight_bytes


def test_stage3_frees_gathered_weights_that_autograd_saved():
    """F.linear saves a view of the weight for backward: freeing a unit by dropping its tensor
    kept every unit's gathered storage alive from forward to backward (all parameters full at
    once, stage 3's point lost). free() resizes the storage to 0 and gather() refills it."""
    for held, weight_bytes in run_ranks(_saved_storages, 2, timeout=120):
        assert held <= 2 * weight_bytes, (held, weight_bytes)  # at most the prefetch in flight
