"""DataParallel and the DDP comm hook against single-process references, on gloo ranks.

Reference: one process trains the same model on the concatenation of every rank's batch,
which is what averaged data-parallel gradients compute. Without compression the parameters
must match it to fp32 rounding (rtol 1e-5: the batch mean is summed in another order);
compressed runs must end within a stated margin of its loss, and replicas bit-identical.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import run_ranks

STEPS, BATCH, DIN = 60, 32, 24


def model():
    torch.manual_seed(0)
    # odd sizes so buckets cut parameters at ragged boundaries
    return nn.Sequential(nn.Linear(DIN, 37), nn.Tanh(), nn.Linear(37, 29), nn.Tanh(),
                         nn.Linear(29, 1))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIN, generator=g)
    w = torch.linspace(-1, 1, DIN)
    return x, torch.tanh(x @ w).unsqueeze(1)  # teacher


def reference(world, steps=STEPS):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in range(steps):
        xs, ys = zip(*[batch(r, s) for r in range(world)])
        loss = nn.functional.mse_loss(m(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m, loss.item()


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _train(rank, world, kind, spec, opts):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyfast.hooks import CompressionState, compression_hook
    from pyfast.parallel.data import DataParallel
    m = model()
    if rank:  # different start: construction must broadcast rank 0's parameters
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
    if kind == "pyfast":
        net = DataParallel(m, spec, **opts)
    else:
        net = DDP(m, bucket_cap_mb=0.001)
        if spec is not None:
            net.register_comm_hook(CompressionState(spec), compression_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for s in range(STEPS):
        x, y = batch(rank, s)
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    out = {"params": flat(m), "loss": losses[-1]}
    if kind == "pyfast":
        out["buckets"] = len(net.bucketer.buckets)
        out["keys"] = list(net.state_dict())
        out["engine"] = net.engine_kind
        if net.selector is not None:
            out["auto"] = (net.selector.fixed, list(net.selector.choice))
        net.close()
    return out


CASES = [("pyfast", "none", {}), ("pyfast", "none", {"overlap": False}),
         ("pyfast", "fp16", {}), ("pyfast", "int8", {}), ("pyfast", "int4", {}),
         ("pyfast", "topk:0.1", {}), ("pyfast", "powersgd:2", {}), ("pyfast", "auto", {}),
         ("ddp", None, {}),
         ("ddp", "int8", {}), ("ddp", "sign", {})]
# Loss margins over the reference's final loss, from the compressors' per-step error:
# lossless or nearly (fp16, int8) 5%, coarser ones (int4, top-10% + EF, rank-2, sign) 50%.
MARGIN = {None: 0.05, "none": 0.05, "fp16": 0.05, "int8": 0.05, "int4": 0.5, "topk:0.1": 0.5,
          "powersgd:2": 0.5, "sign": 0.5, "auto": 0.5}


def _all_cases(rank, world):
    out = {}
    for kind, spec, opts in CASES:
        out[(kind, spec, tuple(opts))] = _train(rank, world, kind, spec,
                                                {"bucket_mb": 0.0002, **opts})
        dist.barrier()
    return out


def test_training_matches_reference(pool2):
    world = pool2.world_size
    ref_model, ref_loss = reference(world)
    out = pool2.run(_all_cases)
    for kind, spec, opts in CASES:
        key = (kind, spec, tuple(opts))
        ranks = [o[key] for o in out]
        for r in range(1, world):
            assert torch.equal(ranks[r]["params"], ranks[0]["params"]), f"{key}: replicas drift"
        if spec in (None, "none"):
            torch.testing.assert_close(ranks[0]["params"], flat(ref_model), rtol=1e-5, atol=1e-6)
        rank_loss = sum(o[key]["loss"] for o in out) / world
        assert rank_loss <= ref_loss * (1 + MARGIN[spec]) + 1e-3, (key, rank_loss, ref_loss)
        if kind == "pyfast":
            assert ranks[0]["buckets"] > 2, "the test must cross bucket boundaries"
            assert ranks[0]["keys"][0].startswith("module."), "state_dict keys as DDP's"
        if kind == "pyfast":  # engine="auto": the native engine wherever it can run
            native = spec not in ("topk:0.1", "powersgd:2")
            assert set(ranks[0]["engine"]) == {"native" if native else "python"}, (key, ranks[0])
        if spec == "auto":
            fixed, choice = ranks[0]["auto"]
            assert fixed and all(o[key]["auto"] == ranks[0]["auto"] for o in out)
            assert set(choice) <= {"fp16", "none", "bf16", "int8", "fp8", "int4"}


def _no_sync(rank, world):
    from pyfast.parallel.data import DataParallel
    out = {}
    for engine in ("native", "python"):
        net = DataParallel(model(), None, bucket_mb=0.001, engine=engine)
        for s in range(3):  # two accumulated micro-batches, the third one syncs
            x, y = batch(rank, s)
            ctx = net.no_sync() if s < 2 else torch.enable_grad()
            with ctx:
                nn.functional.mse_loss(net(x), y).backward()
        out[engine] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        net.close()
    # reduce_gradients(): backward passes that never ran through the wrapper's forward (as
    # Pipeline.step's), reduced afterwards in one call
    net = DataParallel(model(), None, bucket_mb=0.001)
    for s in range(3):
        x, y = batch(rank, s)
        nn.functional.mse_loss(net.module(x), y).backward()
    unreduced = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    net.reduce_gradients()
    out["reduce_gradients"] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    out["changed"] = not torch.equal(unreduced, out["reduce_gradients"])
    out["waited"] = net.last_wait_s
    net.close()
    return out


def test_no_sync_equals_larger_batch(pool2):
    world = pool2.world_size
    out = pool2.run(_no_sync)
    m = model()
    for s in range(3):
        for r in range(world):
            x, y = batch(r, s)
            (nn.functional.mse_loss(m(x), y) / world).backward()
    ref = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    for engine in ("native", "python"):
        assert torch.equal(out[0][engine], out[1][engine]), engine
        torch.testing.assert_close(out[0][engine], ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(out[0]["native"], out[0]["python"])
    # the same buckets and engine as the synced backward: the same bits
    assert torch.equal(out[0]["reduce_gradients"], out[0]["native"])
    assert torch.equal(out[1]["reduce_gradients"], out[1]["native"])
    assert out[0]["changed"] and out[1]["changed"] and out[0]["waited"] > 0


def _bad_inputs(rank, world):
    from pyfast.comm import NonFiniteGradient
    from pyfast.parallel.data import DataParallel
    res = {}
    m = model() if rank == 0 else nn.Sequential(nn.Linear(DIN, 38), nn.Tanh(), nn.Linear(38, 1))
    try:
        DataParallel(m, "int8")
    except ValueError as e:
        res["layout"] = str(e)
    for spec, engine in BAD_CASES:
        net = DataParallel(model(), spec, bucket_mb=0.001, engine=engine, check_finite="raise")
        x, y = batch(rank, 0)
        if rank == 1:
            x[3, 5] = float("nan")
        try:
            nn.functional.mse_loss(net(x), y).backward()
            res[spec, engine] = "no error"
        except NonFiniteGradient as e:
            res[spec, engine] = str(e)
        except RuntimeError as e:  # raised inside autograd's final callback: wrapped
            res[spec, engine] = str(e)
        net.close()
        dist.barrier()
    return res


BAD_CASES = [("int8", "native"), ("int8", "python"), ("topk:0.1", "auto")]


def test_bad_inputs_fail_the_same_way_everywhere(pool2):
    out = pool2.run(_bad_inputs)
    for r in range(2):
        assert "differ across ranks" in out[r]["layout"] and "rank 1" in out[r]["layout"]
        for case in BAD_CASES:
            assert "NaN/Inf" in out[r][case], (r, case, out[r][case])
    assert out[0]["layout"] == out[1]["layout"]


def _state(rank, world):
    from pyfast.parallel.data import DataParallel
    net = DataParallel(model(), "topk:0.1", bucket_mb=0.001)
    x, y = batch(rank, 0)
    nn.functional.mse_loss(net(x), y).backward()
    state = net.compression_state_dict()
    other = DataParallel(model(), "topk:0.1", bucket_mb=0.001)
    other.load_compression_state_dict(state)
    mem = state["state"]["feedback"]["memory"]
    same = all(torch.equal(v, other.compressor.feedback.memory[k]) for k, v in mem.items())
    wrong_net = DataParallel(model(), "int8")
    try:
        wrong_net.load_compression_state_dict(state)
        wrong = "no error"
    except ValueError as e:
        wrong = str(e)
    for n in (net, other, wrong_net):
        n.close()
    return {"n": len(mem), "same": same, "wrong": wrong}


def test_compression_state_round_trip(pool2):
    out = pool2.run(_state)
    assert out[0]["n"] > 0 and out[0]["same"]
    assert "topk:0.1" in out[0]["wrong"] and "int8" in out[0]["wrong"]


def _silent_peer(rank, world):
    import datetime
    import time

    from pyfast.parallel.data import DataParallel
    out = {}
    # rank 1 waits here, on a group no reduction uses, until rank 0 has its error: no sleep
    # (4 s a case before), and "silent" for as long as rank 0 needs, however loaded the box
    side = dist.new_group()
    for engine, own in (("native", False), ("python", False), ("native", True), ("python", True)):
        # the group's own timeout (the engine's private group keeps it), or DataParallel's
        group = None if own else dist.new_group(timeout=datetime.timedelta(seconds=2))
        net = DataParallel(model(), "int8", bucket_mb=0.001, group=group, engine=engine,
                           timeout=2 if own else None)
        engine = f"{engine}{'-timeout' if own else ''}"
        if rank == 1:  # never joins the reduction: rank 0 must get an error, not hang
            out[engine] = "silent"
        else:
            t0 = time.perf_counter()
            x, y = batch(rank, 0)
            try:
                nn.functional.mse_loss(net(x), y).backward()
                out[engine] = "no error"
            except RuntimeError as e:
                out[engine] = f"{time.perf_counter() - t0:.1f}s {e}"
        dist.barrier(group=side)
        net.close()
        dist.barrier()
    return out


def test_silent_peer_is_a_timeout_not_a_hang():
    out = run_ranks(_silent_peer, 2, pg_timeout=120)
    for engine in ("native", "python", "native-timeout", "python-timeout"):
        assert out[1][engine] == "silent"
        took, msg = out[0][engine].split("s ", 1)
        assert float(took) < 30, out[0][engine]  # the launcher's group timeout is 120 s
        assert "DataParallel gradient reduction" in msg, msg
        assert "timed out" in msg.lower() or "timeout" in msg.lower(), out[0][engine]


# ---------------------------------------------------------------- native engine vs Python path
ENGINE_SPECS = {2: ["int8", "fp16", "none", "sign"], 4: ["int8"]}
ENGINE_STEPS = 4


def wide_model():
    torch.manual_seed(0)  # 300K parameters: at 4 ranks the big bucket's int8 goes two-phase
    return nn.Sequential(nn.Linear(DIN, 12000), nn.Tanh(), nn.Linear(12000, 1))


def _steps(net, rank, first, steps):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(first, first + steps):
        x, y = batch(rank, s)
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _same(a, b) -> bool:
    """Nested compression state dicts equal, tensors bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _engine_threads() -> int:
    import glob
    return sum(open(f).read().strip() == "pyfast-engine"
               for f in glob.glob("/proc/self/task/*/comm"))


def _engines(rank, world):
    import pyfast.compress as C
    from pyfast.comm import choose
    from pyfast.parallel.data import DataParallel
    make, mb = (model, 0.0002) if world == 2 else (wide_model, 0.06)
    out = {"params": {}, "bad": [], "kinds": {}}
    for spec in ENGINE_SPECS[world]:
        nets = {}
        for engine in ("native", "python"):
            m = make()
            nets[engine] = net = DataParallel(m, spec, bucket_mb=mb, engine=engine)
            _steps(net, rank, 0, ENGINE_STEPS)
            out["params"][spec, engine] = flat(m)
            out["kinds"][spec, engine] = net.engine_kind
            if not all(b.extra["seconds"] > 0 for b in net.bucketer.buckets):  # auto's input
                out["bad"].append(f"{spec}, {engine}: bucket seconds "
                                  f"{[b.extra['seconds'] for b in net.bucketer.buckets]}")
        if not _same(*(n.compression_state_dict() for n in nets.values())):
            out["bad"].append(f"{spec}: compression state differs between the engines")
        out["algorithms"] = [choose(nets["native"].compressor, b.flat.numel(), world)
                             for b in nets["native"].bucketer.buckets]
        for n in nets.values():
            n.close()
    if world > 2:  # two data-parallel groups (as in a 2 x 2 mesh): each gets its own engine group
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for engine in ("native", "python"):
            m = model()
            net = DataParallel(m, "int8", bucket_mb=0.0002, group=groups[rank // 2],
                               engine=engine)
            _steps(net, rank, 0, 2)
            out["params"]["int8 in groups of 2", engine] = flat(m)
            out["kinds"]["int8 in groups of 2", engine] = net.engine_kind
            net.close()
        return out
    # A checkpoint moves between the engines: 2 steps on one, 2 more on both.
    for first, second in (("native", "python"), ("python", "native")):
        a = DataParallel(model(), "int8", bucket_mb=mb, engine=first)
        _steps(a, rank, 0, 2)
        b = DataParallel(model(), "int8", bucket_mb=mb, engine=second)
        b.load_state_dict(a.state_dict())
        b.load_compression_state_dict(a.compression_state_dict())
        _steps(a, rank, 2, 2)
        _steps(b, rank, 2, 2)
        if not torch.equal(flat(a.module), flat(b.module)) or not _same(
                a.compression_state_dict(), b.compression_state_dict()):
            out["bad"].append(f"checkpoint {first} -> {second}: runs differ after resuming")
        out["threads open"] = _engine_threads()
        for n in (a, b):
            n.close()
    # What only the Python path runs: "native" refuses it, "auto" takes the Python path.
    out["refused"] = {}
    for spec in ("topk:0.1", "powersgd:2", C.get("int8", stochastic=True)):
        try:
            DataParallel(model(), spec, engine="native")
            out["refused"][str(spec)] = "no error"
        except ValueError as e:
            out["refused"][str(spec)] = str(e)
    auto = DataParallel(model(), "topk:0.1", bucket_mb=mb)
    out["auto topk"] = auto.engine_kind
    auto.close()
    auto.close()  # idempotent
    try:
        auto(batch(rank, 0)[0])
        out["after close"] = "no error"
    except RuntimeError as e:
        out["after close"] = str(e)
    out["threads closed"] = _engine_threads()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_native_engine_matches_python_path_bitwise(world):
    out = run_ranks(_engines, world)
    for rank, o in enumerate(out):
        assert not o["bad"], f"rank {rank}: {o['bad']}"
    for spec in ENGINE_SPECS[world]:
        for engine in ("native", "python"):
            assert set(out[0]["kinds"][spec, engine]) == {engine}
            mine = out[0]["params"][spec, engine]
            for r in range(1, world):
                assert torch.equal(out[r]["params"][spec, engine], mine), \
                    f"{spec}, {engine}: rank {r} drifted from rank 0"
        assert torch.equal(out[0]["params"][spec, "native"], out[0]["params"][spec, "python"]), \
            f"{spec}: the native engine and the Python path trained different parameters"
    if world == 4:  # both dense algorithms ran
        assert out[0]["algorithms"] == ["allgather", "two-phase"], out[0]["algorithms"]
        key = "int8 in groups of 2"
        for engine in ("native", "python"):
            assert set(out[0]["kinds"][key, engine]) == {engine}
            for r in range(world):
                assert torch.equal(out[r]["params"][key, engine], out[r]["params"][key, "native"])
                assert torch.equal(out[r]["params"][key, engine],
                                   out[r - r % 2]["params"][key, engine]), f"{key}: rank {r}"
        assert not torch.equal(out[0]["params"][key, "native"], out[2]["params"][key, "native"])
        return
    o = out[0]
    assert len(o["kinds"]["int8", "native"]) > 2, "the test must cross bucket boundaries"
    assert o["threads open"] == 1 and o["threads closed"] == 0, o
    for spec, msg in o["refused"].items():
        assert "engine='native' does not run" in msg and "engine='python'" in msg, (spec, msg)
    assert set(o["auto topk"]) == {"python"}
    assert "closed" in o["after close"], o["after close"]


def _auto_settled_on_none(rank, world):
    """auto fixed at "none" everywhere (a checkpoint's state) against compressor "none", both
    engines: averaged on the way in and summed, as "none" does; bit-identical at W=2. With
    its own bucket size its buckets stay; at the default size none's buckets replace them at
    the next forward."""
    from pyfast.parallel.data import DataParallel
    out = {}
    for engine, mb in (("native", 0.001), ("python", 0.001), ("native", None)):
        ref = DataParallel(model(), "none", bucket_mb=mb, engine=engine)
        net = DataParallel(model(), "auto", bucket_mb=mb, engine=engine)
        state, first = net.compression_state_dict(), net.bucketer
        n = len(state["choice"])
        net.load_compression_state_dict({**state, "choice": ["none"] * n, "fixed": True,
                                         "step": 3, "tnone": [0.0] * n})
        scaled = [b.scale for b in net.bucketer.buckets] == [1.0 / world] * n
        same = True
        for s in range(2):
            x, y = batch(rank, s)
            for m in (ref, net):
                m.module.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
            same &= all(torch.equal(a.grad, b.grad) for a, b in
                        zip(ref.module.parameters(), net.module.parameters()))
        regrouped = net.bucketer is not first and len(net.bucketer.buckets) == \
            len(ref.bucketer.buckets) and net._through == ref._through
        out[f"{engine} {mb}"] = (same, scaled, n, regrouped == (mb is None),
                                 net.compression_state_dict()["choice"] == ["none"] * n)
        ref.close()
        net.close()
    return out


def test_auto_settled_on_none_reduces_as_none(pool2):
    for case, (same, scaled, n, regrouped, kept) in pool2.run(_auto_settled_on_none)[0].items():
        assert same and scaled and regrouped and kept, case
        assert n > 1 or case.endswith("None"), case
