"""pyfast.parallel.zero against one process and against DataParallel + the same optimizer.

Reference: one process running the same data. Each rank trains on its own micro-batch and the
reference averages the W micro-batch losses (so BatchNorm sees the same per-micro-batch
statistics, as under any data parallelism; for the MLP this is the mean over the concatenated
batch). Tolerance vs one process: the gradient average is summed in another order (gloo's
reduce-scatter vs autograd's one batch), a relative difference of a few fp32 ulps per gradient;
AdamW's update is lr * m / (sqrt(v) + eps), at most ~lr per element and step, and a relative
gradient error e changes it by about e * lr (m and sqrt(v) move together), so after 3 steps at
lr 1e-2 the parameters agree to ~3 * 1e-2 * 1e-6 = 3e-8; we assert atol 1e-6 (relative to
parameters of scale ~0.1-1): 30x headroom, still 1e4 below one step's update (1e-2), so a missed
or doubled gradient fails it. Against DataParallel (the same per-rank arithmetic, another
reduction) the same bound. The argument needs a gradient well above its own rounding noise:
elements whose one-process gradient is below NOISE (1e-6, against gradients of 1e-3..1e-1) at
some step -- gpt-tiny's attention key biases, nearly invariant under softmax, have such
elements -- get a relative gradient error of 1e-3 or more, which AdamW's normalization turns
into update differences up to lr; they are held to 2 * lr * STEPS (what AdamW can move them)
instead. Exact zeros (embedding rows no token used) are exact in both and pass the tight bound.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dist_utils import RankPool

STEPS, LR, WD = 3, 1e-2, 0.1
ATOL, NOISE = 1e-6, 1e-6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(37, 129), nn.Linear(129, 37)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Tied(nn.Module):
    """LayerNorm 37, a bias, a BatchNorm buffer, a tied embedding/head, a frozen parameter and
    a parameter no rank uses (AdamW must not decay it: DataParallel leaves its grad None)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(29, 37)
        self.ln = nn.LayerNorm(37)
        self.lin = nn.Linear(37, 37)
        self.bn = nn.BatchNorm1d(37)
        self.head = nn.Linear(37, 29, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.full((37,), 0.5), requires_grad=False)
        self.unused = nn.Linear(3, 3)

    def forward(self, ids):
        h = self.ln(self.emb(ids)) * self.scale
        h = self.bn(torch.tanh(self.lin(h)))
        return self.head(h)


def _gpt():
    from pyfast.models import build
    return build("gpt-tiny", vocab_size=64, seq_len=16)


MODELS = {"mlp": MLP, "tied": Tied, "gpt": _gpt}


def _data(kind, world, step, per=4):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        x = torch.randn(world * per, 37, generator=g)
        return x.chunk(world), torch.randn(world * per, 37, generator=g).chunk(world)
    v, t = (29, None) if kind == "tied" else (64, 16)
    shape = (world * per,) if t is None else (world * per, t)
    ids = torch.randint(0, v, shape, generator=g)
    return ids.chunk(world), torch.randint(0, v, shape, generator=g).chunk(world)


def _loss(kind, model, x, y):
    out = model(x)
    if kind == "mlp":
        return torch.nn.functional.mse_loss(out, y)
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _build(kind):
    torch.manual_seed(0)
    return MODELS[kind]()


def _reference(kind, world, steps=STEPS):
    """One process: the average of the W micro-batch losses, AdamW."""
    m = _build(kind)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WD)
    noisy = {k: torch.zeros(p.shape, dtype=torch.bool) for k, p in m.named_parameters()}
    for s in range(steps):
        xs, ys = _data(kind, world, s)
        loss = sum(_loss(kind, m, x, y) for x, y in zip(xs, ys)) / world
        loss.backward()
        for k, p in m.named_parameters():
            if p.grad is not None:
                noisy[k] |= (p.grad.abs() < NOISE) & (p.grad != 0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.named_parameters()}, noisy


def _close(a, b, noisy, what):
    """a == b within ATOL, or 2 * LR * STEPS where the gradient was at its noise level."""
    bound = torch.where(noisy, torch.tensor(2 * LR * STEPS), torch.tensor(ATOL))
    bad = (a - b).abs() > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{a.numel()} elements off, largest "
                           f"{float((a - b).abs().max()):.3g}")


# stage 3's wrapped modules: the tied weight (emb and head) goes to the root, LayerNorm and lin
# to units of their own; gpt-tiny: the default (the children of the GPT nn.Sequential)
UNITS = {"mlp": [nn.Linear], "tied": [nn.Linear, nn.Embedding, nn.LayerNorm], "gpt": None}


def _params(model):
    """The full parameters (stage 3: gathered for the look, then freed again)."""
    if model.stage == 3:
        for u in model.layout.units:
            model.gather(u)
    out = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    if model.stage == 3:
        model.free_all()
    return out


def _train_zero(rank, world, kind, stage, compressor=None):
    from pyfast.parallel import zero
    model, opt = zero(_build(kind), torch.optim.AdamW, stage=stage, compressor=compressor,
                      lr=LR, weight_decay=WD, units=UNITS[kind] if stage == 3 else None)
    every = []
    for s in range(STEPS):
        xs, ys = _data(kind, world, s)
        _loss(kind, model, xs[rank], ys[rank]).backward()
        opt.step()
        opt.zero_grad()
        every.append(_params(model))
    return every


def _train_dp(rank, world, kind):
    from pyfast.parallel import DataParallel
    dp = DataParallel(_build(kind), engine="python")
    opt = torch.optim.AdamW([p for p in dp.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WD)
    for s in range(STEPS):
        xs, ys = _data(kind, world, s)
        _loss(kind, dp, xs[rank], ys[rank]).backward()
        opt.step()
        opt.zero_grad()
    dp.close()
    return {k: v.detach().clone() for k, v in dp.module.named_parameters()}


def _cases(rank, world, cases):
    out = {}
    for kind, stage in cases:
        out[(kind, stage)] = _train_zero(rank, world, kind, stage)
    for kind in dict.fromkeys(k for k, _ in cases):
        out[(kind, "dp")] = _train_dp(rank, world, kind)
    return out


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4) as pool:
        yield pool


def _check_against_references(out, world, cases):
    refs = {kind: _reference(kind, world) for kind in dict.fromkeys(k for k, _ in cases)}
    for kind, stage in cases:
        steps = [r[(kind, stage)] for r in out]
        for s in range(STEPS):  # replicas bit-identical after every step
            for r in range(1, world):
                for k, v in steps[0][s].items():
                    assert torch.equal(v, steps[r][s][k]), (kind, stage, s, r, k)
        last = steps[0][-1]
        assert set(last) == set(refs[kind][0])
        ref, noisy = refs[kind]
        for k, v in last.items():
            _close(v, ref[k], noisy[k], f"{kind} stage {stage} {k} vs one process")
            _close(v, out[0][(kind, "dp")][k], noisy[k], f"{kind} stage {stage} {k} vs DataParallel")
        ref0 = _build(kind)
        moved = [k for k, p in ref0.named_parameters() if not torch.equal(p, last[k])]
        assert "unused.weight" not in moved  # AdamW skipped it: no rank produced a gradient
        assert "scale" not in moved  # frozen
        assert len(moved) >= len(last) - 3


CASES2 = [(k, s) for k in ("mlp", "tied", "gpt") for s in (1, 2, 3)]
CASES4 = [(k, s) for k in ("mlp", "tied") for s in (1, 2, 3)]


def test_stages_match_one_process_and_dataparallel_2_ranks(pool2):
    _check_against_references(pool2.run(_cases, CASES2), 2, CASES2)


def test_stages_match_one_process_and_dataparallel_4_ranks(pool4):
    _check_against_references(pool4.run(_cases, CASES4), 4, CASES4)
