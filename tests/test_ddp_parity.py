"""DataParallel keeps DistributedDataParallel's semantics: unused and frozen parameters, buffer
broadcast, GradScaler overflow steps, dtypes, tied parameters, and per-parameter compression
error. Each case runs DataParallel and torch's DDP side by side on the same ranks."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import run_ranks

ENGINES = ("native", "python")


class Branchy(nn.Module):
    """A LayerNorm of odd size, biases, a branch only some ranks use, one no rank uses, and a
    frozen layer: shaped like the models that break naive bucketing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(13, 37)
        self.norm = nn.LayerNorm(37)
        self.bn = nn.BatchNorm1d(37)
        self.rare = nn.Linear(37, 37)    # used on rank 1 only
        self.never = nn.Linear(37, 5)    # used by no rank
        self.frozen = nn.Linear(37, 37)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(37, 3)

    def forward(self, x, use_rare: bool):
        h = self.bn(self.norm(torch.tanh(self.inp(x))))
        h = self.frozen(h)
        if use_rare:
            h = h + torch.tanh(self.rare(h))
        return self.out(h)


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)


def _semantics(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyfast.parallel.data import DataParallel
    out = {}
    for kind in ("ddp",) + ENGINES:
        m = Branchy()
        if rank:  # construction must broadcast rank 0's parameters and buffers
            with torch.no_grad():
                m.inp.weight.add_(1.0)
                m.bn.running_mean.add_(3.0)
        net = (DDP(m, bucket_cap_mb=0.001, find_unused_parameters=True) if kind == "ddp" else
               DataParallel(m, None, bucket_mb=0.001, engine=kind))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for s in range(3):
            x, y = _batch(rank, s)
            opt.zero_grad()
            nn.functional.mse_loss(net(x, rank == 1), y).backward()
            grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in m.named_parameters()}
            opt.step()
        out[kind] = {"grads": grads, "state": {k: v.clone() for k, v in m.state_dict().items()}}
        if kind != "ddp":
            net.sync_buffers()
            out[kind]["synced"] = {k: v.clone() for k, v in m.named_buffers()}
            m.norm.weight.requires_grad_(False)  # frozen after wrapping: refused, never diverges
            try:
                net(x, False)
                out[kind]["frozen"] = "no error"
            except RuntimeError as e:
                out[kind]["frozen"] = str(e)
            net.close()
        dist.barrier()
    return out


def test_unused_frozen_buffers_match_ddp():
    out = run_ranks(_semantics, 2)
    for rank in range(2):
        ddp = out[rank]["ddp"]
        assert ddp["grads"]["never.weight"] is None and ddp["grads"]["frozen.weight"] is None
        for kind in ENGINES:
            mine = out[rank][kind]
            for n, g in ddp["grads"].items():
                if g is None:  # never used anywhere / frozen: .grad stays None, as in DDP
                    assert mine["grads"][n] is None, (kind, n)
                else:  # rank 1's rare branch is averaged with rank 0's zeros
                    torch.testing.assert_close(mine["grads"][n], g, rtol=1e-5, atol=1e-6)
            # parameters and BatchNorm statistics (rank 0's broadcast at every forward)
            for k, v in ddp["state"].items():
                torch.testing.assert_close(mine["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
            assert "norm.weight" in mine["frozen"] and "wrap it again" in mine["frozen"]
    for kind in ENGINES:
        for k, v in out[0][kind]["synced"].items():
            assert torch.equal(out[1][kind]["synced"][k], v), k
    # the case is not vacuous: rank 1 used the rare branch, the statistics moved
    assert out[0]["ddp"]["grads"]["rare.weight"].abs().sum() > 0
    assert not torch.equal(out[0]["ddp"]["state"]["bn.running_mean"], torch.zeros(37))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(29, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 29, bias=False)
        self.head.weight = self.emb.weight  # one Parameter used twice

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def _tied_and_dtypes(rank, world):
    from pyfast.parallel.data import DataParallel
    out = {}
    for engine in ENGINES:
        m = Tied()
        net = DataParallel(m, None, bucket_mb=0.001, engine=engine)
        idx = torch.randint(0, 29, (6, 5), generator=torch.Generator().manual_seed(rank))
        nn.functional.cross_entropy(net(idx).flatten(0, 1), idx.flatten()).backward()
        out[engine] = m.emb.weight.grad.clone()
        net.close()
    m = nn.Sequential(nn.Linear(9, 7), nn.Linear(7, 3)).to(torch.bfloat16)
    m[0].bias.data = m[0].bias.data.half()  # a bf16 and an fp16 gradient in one bucket
    net = DataParallel(m, None, engine="python")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 9, generator=g).to(torch.bfloat16)
    # gradients set by hand: the autograd of mixed dtypes is not the point here
    local = [torch.randn(p.shape, generator=g).to(p.dtype) for p in m.parameters()]
    for p, v in zip(m.parameters(), local):
        p.grad = v.clone()
    net.reduce_gradients()
    out["mixed"] = [(v, p.grad.clone()) for v, p in zip(local, m.parameters())]
    net.close()
    try:
        DataParallel(nn.Linear(3, 3).double(), None)
        out["fp64"] = "no error"
    except ValueError as e:
        out["fp64"] = str(e)
    return out


def test_tied_parameters_reduced_once_and_dtypes():
    out = run_ranks(_tied_and_dtypes, 2)
    ref = Tied()  # one process, both ranks' batches: the mean of their losses
    loss = 0
    for r in range(2):
        idx = torch.randint(0, 29, (6, 5), generator=torch.Generator().manual_seed(r))
        loss = loss + nn.functional.cross_entropy(ref(idx).flatten(0, 1), idx.flatten()) / 2
    loss.backward()
    for engine in ENGINES:
        for r in range(2):
            torch.testing.assert_close(out[r][engine], ref.emb.weight.grad, rtol=1e-5, atol=1e-6)
    for i, ((a, got0), (b, got1)) in enumerate(zip(out[0]["mixed"], out[1]["mixed"])):
        # fp32 buckets: the exact average of the two widened values, rounded once
        want = ((a.float() + b.float()) / 2).to(a.dtype)
        assert got0.dtype == a.dtype and torch.equal(got0, want) and torch.equal(got1, want), i
    assert "'weight' is torch.float64" in out[0]["fp64"], out[0]["fp64"]
