"""DataParallel keeps DistributedDataParallel's semantics: unused and frozen parameters, buffer
broadcast, GradScaler overflow steps, dtypes, tied parameters, and per-parameter compression
error. Each case runs DataParallel and torch's DDP side by side on the same ranks."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import RankPool, run_ranks

ENGINES = ("native", "python")


@pytest.fixture(scope="module")
def pool():
    """Two ranks spawned once for the module's cases (spawning costs ~2 s a rank here)."""
    with RankPool(2) as p:
        yield p


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
    for kind in ("ddp", "hook") + ENGINES:
        m = Branchy()
        if rank:  # construction must broadcast rank 0's parameters and buffers
            with torch.no_grad():
                m.inp.weight.add_(1.0)
                m.bn.running_mean.add_(3.0)
        if kind in ("ddp", "hook"):  # DDP issues its used-map all-reduce beside the hook's
            net = DDP(m, bucket_cap_mb=0.001, find_unused_parameters=True)
            if kind == "hook":
                from pyfast.hooks import CompressionState, compression_hook
                net.register_comm_hook(CompressionState("none"), compression_hook)
        else:
            net = DataParallel(m, None, bucket_mb=0.001, engine=kind)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for s in range(3):
            x, y = _batch(rank, s)
            opt.zero_grad()
            nn.functional.mse_loss(net(x, rank == 1), y).backward()
            grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in m.named_parameters()}
            opt.step()
        out[kind] = {"grads": grads, "state": {k: v.clone() for k, v in m.state_dict().items()}}
        if kind in ENGINES:
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


@pytest.mark.parametrize("world", [2, 4])
def test_unused_frozen_buffers_match_ddp(pool, world):
    out = pool.run(_semantics) if world == 2 else run_ranks(_semantics, world)
    for rank in range(world):
        ddp = out[rank]["ddp"]
        assert ddp["grads"]["never.weight"] is None and ddp["grads"]["frozen.weight"] is None
        hook = out[rank]["hook"]  # DDP + pyfast's hook ("none") is DDP, bit for bit
        for n, g in ddp["grads"].items():
            assert (g is None and hook["grads"][n] is None) or torch.equal(hook["grads"][n], g), n
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
            assert all(torch.equal(o[kind]["synced"][k], v) for o in out), k
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
    except TypeError as e:  # a wrong dtype is a TypeError
        out["fp64"] = str(e)
    return out


def test_tied_parameters_reduced_once_and_dtypes(pool):
    out = pool.run(_tied_and_dtypes)
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


def _net():
    torch.manual_seed(2)  # 64-element norms between 48x64 / 64x64 layers, as in a small Llama
    return nn.Sequential(nn.Linear(48, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                         nn.LayerNorm(64), nn.Linear(64, 10))


def _scaler(rank, world):
    """int8 + error feedback under torch.amp.GradScaler; at step 2 rank 1's last bias gradient
    overflows (inf): every rank must skip that step, halve the scale and go on."""
    out = {}
    for engine in ENGINES + ("hook",):
        m = _net()
        net, memory = _wrap(m, "int8", engine, 0.002)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        rows = []
        for s in range(5):
            x, y = torch.randn(16, 48), torch.randn(16, 10)
            h = None
            if s == 2 and rank == 1:
                h = m[5].bias.register_hook(lambda g: g * float("inf"))
            before = [p.detach().clone() for p in m.parameters()]
            mem = {k: v.clone() for k, v in memory().items()}
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            if h is not None:
                h.remove()
            after = memory()
            rows.append({"scale": scaler.get_scale(), "skipped": net.skipped,
                         "moved": any(not torch.equal(a, p) for a, p in zip(before, m.parameters())),
                         "mem_same": mem.keys() == after.keys() and all(torch.equal(mem[k], after[k]) for k in mem),
                         "mem_finite": all(bool(v.isfinite().all()) for v in after.values()),
                         "params": torch.cat([p.detach().reshape(-1) for p in m.parameters()])})
        out[engine] = rows
        net.close()
    return out


class _Hooked:
    """DDP with pyfast's compression hook, shaped like DataParallel for these tests."""

    def __init__(self, m, spec, mb, unused=False):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from pyfast.hooks import CompressionState, compression_hook
        self.ddp = DDP(m, bucket_cap_mb=mb, find_unused_parameters=unused)
        self.state = CompressionState(spec)
        self.ddp.register_comm_hook(self.state, compression_hook)

    def __call__(self, *a):
        return self.ddp(*a)

    @property
    def skipped(self):
        return self.state.skipped

    def close(self):
        pass


def _wrap(m, spec, engine, mb):
    """(wrapped module, a function returning the error-feedback memory)."""
    from pyfast.parallel.data import DataParallel
    if engine == "hook":
        net = _Hooked(m, spec, mb)
        return net, lambda: net.state.compressor.feedback.memory
    net = DataParallel(m, spec, bucket_mb=mb, engine=engine)
    return net, lambda: net.compression_state_dict()["state"]["feedback"]["memory"]


def test_grad_scaler_overflow_skips_the_same_step_everywhere(pool):
    out = pool.run(_scaler)
    for engine in ENGINES + ("hook",):
        r0, r1 = out[0][engine], out[1][engine]
        for s, (a, b) in enumerate(zip(r0, r1)):
            assert torch.equal(a["params"], b["params"]) and a["scale"] == b["scale"], (engine, s)
            assert a["skipped"] == b["skipped"] == (s == 2), (engine, s)
            assert a["mem_finite"] and b["mem_finite"], (engine, s)  # an inf never entered
            assert a["moved"] == (s != 2), (engine, s)  # skipped, then training goes on
        assert r0[2]["scale"] == r0[1]["scale"] / 2 and r0[3]["scale"] == r0[2]["scale"]
        # the skipped step left the feedback memory as it was, on the rank that overflowed
        # and on the finite one; the other steps changed it
        assert r0[2]["mem_same"] and r1[2]["mem_same"], engine
        assert not r0[3]["mem_same"] and not r0[1]["mem_same"], engine


ALONE_SPECS = ("int8", "int4", "fp8", "topk:0.1")


def _alone(rank, world):
    """Each parameter's reduced gradient through DataParallel vs the same gradient reduced
    alone (pyfast.comm.all_reduce, the same compressor, fresh memory): the same numbers."""
    import pyfast.compress as C
    from pyfast.comm import all_reduce
    from pyfast.parallel.data import DataParallel
    out = {}
    for spec in ALONE_SPECS:
        for engine in (ENGINES if spec != "topk:0.1" else ("python",)) + ("hook",):
            m = _net()
            g = torch.Generator().manual_seed(7 + rank)
            x, y = torch.randn(16, 48, generator=g), torch.randn(16, 10, generator=g)
            nn.functional.mse_loss(m(x), y).backward()  # the module: no reduction yet
            local = {n: p.grad.clone() for n, p in m.named_parameters()}
            if engine == "hook":  # one DDP bucket holds all
                m.zero_grad()
                hooked = _Hooked(m, spec, 1.0)  # alive until backward is done
                nn.functional.mse_loss(hooked(x), y).backward()
            else:
                net = DataParallel(m, spec, bucket_mb=1.0, engine=engine)  # one bucket holds all
                net.reduce_gradients()
                net.close()
            got = {n: p.grad.clone() for n, p in m.named_parameters()}
            alone = {n: all_reduce(v.clone(), C.get(spec), op="avg", name=n)
                     for n, v in local.items()}
            exact = {n: all_reduce(v.clone(), None, op="avg") for n, v in local.items()}
            out[spec, engine] = {n: ((got[n] - exact[n]).norm() / exact[n].norm(),
                                     (alone[n] - exact[n]).norm() / exact[n].norm(),
                                     torch.equal(got[n], alone[n])) for n in got}
    return out


def test_compression_error_does_not_depend_on_neighbours(pool):
    out = pool.run(_alone)
    for key, per in out[0].items():
        for n, (err, err_alone, same) in per.items():
            # same blocks, same arithmetic: bit for bit, and so the same relative error
            assert same, (key, n, float(err), float(err_alone))
    # not vacuous: the lossy formats do lose something
    assert max(float(e) for e, _, _ in out[0]["int8", "native"].values()) > 1e-4
    assert ("int8", "hook") in out[0] and ("topk:0.1", "hook") in out[0]


def _killed(rank, world, engine, spec):
    """Rank 2 is SIGKILLed in the middle of backward of step 1; the others must raise CommError
    naming the reduction within seconds, then refuse the next step."""
    import os
    import signal
    import time

    m = _net()
    if engine == "hook":  # DDP with the hook: the group's own timeout (none set here)
        net = _Hooked(m, spec, 0.002)
    else:
        from pyfast.parallel.data import DataParallel
        net = DataParallel(m, spec, bucket_mb=0.002, engine=engine, timeout=20)
    if rank == 2:
        m[1].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL) if step else g)
    out = {}
    for step in range(2):
        x, y = torch.randn(16, 48), torch.randn(16, 10)
        t0 = time.monotonic()
        try:
            nn.functional.mse_loss(net(x), y).backward()
        except RuntimeError as e:  # CommError; through DDP's reducer, a RuntimeError quoting it
            out["error"], out["seconds"] = str(e), time.monotonic() - t0
            break
    try:
        nn.functional.mse_loss(net(x), y).backward()
        out["after"] = "no error"
    except RuntimeError as e:
        out["after"] = str(e)
    return out


@pytest.mark.parametrize("engine,spec", [("native", "int8"), ("hook", "int8")])
def test_killed_peer_raises_within_seconds_and_breaks(engine, spec):
    out = run_ranks(_killed, 3, engine, spec, expect_errors=True, timeout=60)
    assert out[2].kind == "died"
    who = "compression_hook reduction" if engine == "hook" else "DataParallel gradient reduction"
    for r in (0, 1):
        assert not isinstance(out[r], Exception), out[r]
        assert who in out[r]["error"], out[r]
        assert "all_reduce of bucket" in out[r]["error"] and "failed on rank" in out[r]["error"]
        assert out[r]["seconds"] < 10, out[r]  # measured 0.0x s: a reset, not a timeout
        assert "broken by an earlier failure" in out[r]["after"], out[r]


META_CASES = [("native", "int8"), ("python", "int8"), ("python", "topk:0.1"),
              ("python", "powersgd:2"), ("native", "none"), ("hook", "int8"), ("hook", "topk:0.1")]


def _meta(rank, world):
    """Two steps of each case with torch's default device "meta" and every user tensor on the
    CPU: a buffer that does not follow its tensors' device is a meta tensor and fails."""
    cpu = torch.device("cpu")  # explicit, as a user's CUDA tensors would be
    out = {}
    for meta in (False, True):
        for engine, spec in META_CASES:
            torch.set_default_device("meta" if meta else None)
            try:
                with torch.device(cpu):
                    m = Branchy()
                    g = torch.Generator(device=cpu).manual_seed(rank)
                    xs = [(torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g))
                          for _ in range(2)]
                if engine == "hook":
                    m = m.to(cpu)
                    net = _Hooked(m, spec, 0.0005, unused=True)
                else:
                    from pyfast.parallel.data import DataParallel
                    net = DataParallel(m, spec, bucket_mb=0.0005, engine=engine)
                for x, y in xs:
                    nn.functional.mse_loss(net(x, rank == 1), y).backward()
                got = torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])
                assert got.device == cpu, got.device
                out[meta, engine, spec] = got.clone()
                net.close()
            except Exception as e:  # reported all at once by the test
                out[meta, engine, spec] = f"{type(e).__name__}: {e}"
            finally:
                torch.set_default_device(None)
    return out


def test_buffers_follow_the_parameters_device(pool):
    out = pool.run(_meta)
    bad = {k: v for o in out for k, v in o.items() if isinstance(v, str)}
    assert not bad, bad
    for engine, spec in META_CASES:
        for r in range(2):
            assert torch.equal(out[r][True, engine, spec], out[r][False, engine, spec]), (engine, spec)


REBUILD_SPECS = ("none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk:0.01",
                 "randomk:0.1", "powersgd:2")
SAME_AS_DP = ("none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk:0.01")


def _mlp():
    torch.manual_seed(3)  # the model: one DDP bucket of 76810 elements
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _train(wrapped, x, y, steps):
    """(losses, the reduced gradients) of `steps` SGD steps on one batch."""
    opt = torch.optim.SGD(wrapped.module.parameters(), lr=0.05)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.reshape(-1) for p in wrapped.module.parameters()]))
        opt.step()
    return losses, grads


def _rebuild(rank, world, steps=4):
    """Plain DDP, DDP + the hook under every compressor (find_unused_parameters off and on),
    and DataParallel (its buckets never change: the reference for state kept per parameter),
    `steps` SGD steps on one fixed batch per rank. DDP rebuilds its buckets after step 1
    (same index and size, another parameter order)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyfast.hooks import CompressionState, compression_hook
    from pyfast.parallel.data import DataParallel
    g = torch.Generator().manual_seed(11 + rank)
    x, y = torch.randn(24, 32, generator=g), torch.randn(24, 10, generator=g)
    out = {}
    for kind in ("ddp",) + REBUILD_SPECS + tuple("dp:" + s for s in SAME_AS_DP):
        for unused in (False, True) if not kind.startswith("dp:") else (False,):
            state = None
            try:
                if kind.startswith("dp:"):
                    net = DataParallel(_mlp(), kind[3:], bucket_mb=1.0, engine="python")
                else:
                    net = DDP(_mlp(), find_unused_parameters=unused)
                    if kind != "ddp":
                        state = CompressionState(kind)
                        net.register_comm_hook(state, compression_hook)
                losses, grads = _train(net, x, y, steps)
                fb = state and state.compressor.feedback
                out[kind, unused] = {"losses": losses, "grads": grads,
                                     "memory": sorted(fb.memory) if fb else None}
            except Exception as e:  # reported by the test, every case at once
                out[kind, unused] = f"{type(e).__name__}: {e}"
            if kind.startswith("dp:"):
                net.close()
    return out


def test_hook_state_survives_ddp_bucket_rebuild(pool):
    out = pool.run(_rebuild, timeout=300)
    bad = {k: v for o in out for k, v in o.items() if isinstance(v, str)}
    assert not bad, bad
    r0, r1 = out
    for (kind, unused), res in r0.items():
        # every rank decodes the same bytes in the same order: identical gradients
        assert all(torch.equal(a, b) for a, b in zip(res["grads"], r1[kind, unused]["grads"])), \
            (kind, unused)
        assert res["losses"][-1] < res["losses"][0], (kind, unused, res["losses"])
    for unused in (False, True):
        ddp = r0["ddp", unused]
        for kind in REBUILD_SPECS:
            hook = r0[kind, unused]
            if kind == "none":  # the hook's exact reduction is DDP's: fp32 sums of 2 terms
                for a, b in zip(hook["grads"], ddp["grads"]):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            if kind in SAME_AS_DP:
                # DataParallel keeps its buckets: the same compressor, memory and data give the
                # same numbers, step after step, only if the hook's memory followed each
                # parameter through DDP's rebuild (blocks start at each parameter in both)
                for s, (a, b) in enumerate(zip(hook["grads"], r0["dp:" + kind, False]["grads"])):
                    assert torch.equal(a, b), (kind, unused, s, float((a - b).abs().max()))
            if kind in ("topk:0.01", "powersgd:2"):  # per-tensor state: one name a parameter
                # (powersgd sends vectors as they are: no memory for the biases)
                names = {f"bucket.p{k}" for k in range(6)}
                assert hook["memory"] and set(hook["memory"]) <= names, hook["memory"]
            elif hook["memory"] is not None:  # staged: one memory for the bucket's 6 parameters
                assert hook["memory"] == ["bucket[p0-5]"], hook["memory"]
