"""pyfast.comm.ready, the bucket engine of DataParallel and ZeRO, in one process (launch order,
the final callback, an unused parameter, overlap off, the parameter-change check); on two ranks,
DataParallel's gradients as bucket views and check_finite="skip" left to the reduction."""
import pytest
import torch
from torch import nn

from pyfast.comm.ready import Readiness, ParamWatch, check_unchanged


def _net():
    # ragged widths; "skip" is used on some steps only (an unused parameter, as with DDP)
    return nn.ModuleDict({"a": nn.Linear(7, 13), "b": nn.Linear(13, 5), "skip": nn.Linear(13, 5)})


def _run(net, ready, use_skip: bool):
    x = torch.randn(4, 7)
    h = torch.tanh(net["a"](x))
    out = net["b"](h) + (net["skip"](h) if use_skip else 0)
    ready.arm()
    out.square().sum().backward()


def _engine(net, enabled=True):
    # buckets in the order backward produces gradients: b, skip, then a
    groups = [list(net["b"].parameters()), list(net["skip"].parameters()),
              list(net["a"].parameters())]
    log = []
    ready = Readiness(groups, lambda i: log.append(("launch", i, ready.armed)),
                      lambda: log.append(("final",)), enabled,
                      complete=lambda i: log.append(("complete", i)))
    return ready, log


def test_buckets_launch_in_order_while_backward_runs_and_final_runs_once():
    net = _net()
    ready, log = _engine(net)
    _run(net, ready, use_skip=True)
    launches = [e for e in log if e[0] == "launch"]
    assert [e[1] for e in launches] == [0, 1, 2] and all(e[2] for e in launches), log
    assert log[-1] == ("final",) and log.count(("final",)) == 1
    # every bucket completed before it was launched
    for i in range(3):
        assert log.index(("complete", i)) < log.index(("launch", i, True))
    assert not ready.armed


def test_a_bucket_with_an_unused_parameter_holds_back_the_later_ones_until_the_end():
    net = _net()
    ready, log = _engine(net)
    _run(net, ready, use_skip=False)
    launches = [(e[1], e[2]) for e in log if e[0] == "launch"]
    # bucket 0 went during backward; bucket 1 (never completed) and 2 (behind it, in order)
    # from the final callback, after the engine was disarmed
    assert launches == [(0, True), (1, False), (2, False)], log
    assert ("complete", 1) not in log and log[-1] == ("final",)


def test_overlap_off_and_disarmed_backward():
    net = _net()
    ready, log = _engine(net, enabled=False)
    _run(net, ready, use_skip=True)
    assert [e[1] for e in log if e[0] == "launch"] == [0, 1, 2]
    assert all(not e[2] for e in log if e[0] == "launch")  # all at the end
    log.clear()
    ready.disarm()  # as under no_sync: hooks do nothing, no callback is queued
    out = net["b"](torch.tanh(net["a"](torch.randn(3, 7))))
    out.sum().backward()
    assert log == []
    ready.close()
    _run(net, ready, use_skip=True)  # armed, but the hooks are gone
    assert log == []


def test_parameter_change_is_named():
    net = _net()
    named = [(n, p) for n, p in net.named_parameters()]
    check_unchanged(net, named, "X was built")  # unchanged: no error
    net["b"].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"removed or frozen: \['b.bias'\]\): wrap it again"):
        check_unchanged(net, named, "X was built")
    net["b"].bias.requires_grad_(True)
    net["c"] = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"after X was built \(added or unfrozen: \['c.weight'"):
        check_unchanged(net, named, "X was built")


def _views(rank, world):
    from pyfast.parallel.data import DataParallel
    out, seen = {}, []
    for none in (True, False):  # zero_grad(set_to_none=...): copied in, or accumulated in place
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(9, 31), nn.Tanh(), nn.Linear(31, 3))
        net = DataParallel(m, None, bucket_mb=0.0001, engine="python",
                           gradient_as_bucket_view=True)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        flats = {b.flat.untyped_storage().data_ptr() for b in net.bucketer.buckets}
        for _ in range(3):
            opt.zero_grad(set_to_none=none)
            before = [p.grad for p in m.parameters()]
            net(torch.randn(5, 9, generator=g)).square().sum().backward()
            seen.append(all(p.grad.untyped_storage().data_ptr() in flats
                            for p in m.parameters()))
            if not none and before[0] is not None:  # the same tensors, written in place
                seen.append(all(a is p.grad for a, p in zip(before, m.parameters())))
            opt.step()
        out[none] = [p.detach().clone() for p in m.parameters()]
        net.close()
    return out, seen, len(net.bucketer.buckets)


def test_gradients_are_bucket_views_and_accumulate_in_place(pool2):
    for out, seen, buckets in pool2.run(_views):
        assert buckets >= 2 and all(seen) and len(seen) == 8, (buckets, seen)
        # 0 + g written in place is g copied: the same bits either way
        for a, b in zip(out[True], out[False]):
            assert torch.equal(a, b)


def _through(rank, world):
    """GradScaler over DataParallel with nothing to put back (none, bf16): no finite check runs,
    the inf crosses the reduction; every rank must still skip step 1 and go on."""
    from pyfast.parallel.data import DataParallel
    out = {}
    for spec, engine in (("none", "native"), ("none", "python"), ("bf16", "native")):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(11, 29), nn.Tanh(), nn.Linear(29, 3))
        net = DataParallel(m, spec, bucket_mb=0.0001, engine=engine)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        g = torch.Generator().manual_seed(rank)
        rows = []
        for s in range(3):
            h = None
            if s == 1 and rank == 1:
                h = m[2].bias.register_hook(lambda grad: grad * float("inf"))
            before = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            opt.zero_grad()
            scaler.scale(net(torch.randn(6, 11, generator=g)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            if h is not None:
                h.remove()
            after = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            rows.append((net.skipped, scaler.get_scale(), not torch.equal(before, after), after))
        out[spec, engine] = (net._through, rows)
        net.close()
    return out


def test_skip_without_a_check_when_nothing_must_be_put_back(pool2):
    r0, r1 = pool2.run(_through)
    for key, (through, rows) in r0.items():
        assert through and r1[key][0], key  # no local check ran
        for s, (a, b) in enumerate(zip(rows, r1[key][1])):
            assert a[0] == b[0] == (s == 1), (key, s)  # skipped on both ranks, at step 1 only
            assert a[1] == b[1] and a[2] == b[2] == (s != 1), (key, s)
            assert torch.equal(a[3], b[3]), (key, s)  # the replicas stay equal
        assert rows[1][1] == rows[0][1] / 2  # the scale backed off once


def test_param_watch_walks_only_after_a_possible_change(monkeypatch):
    """ParamWatch: no walk of the module while nothing changed; each way of changing the
    trainable parameters is caught at the next check (the walk then names it)."""
    import pyfast.comm.ready as ready_mod
    walks = []
    real = ready_mod.check_unchanged
    monkeypatch.setattr(ready_mod, "check_unchanged", lambda *a: (walks.append(1), real(*a)))

    def fresh():
        net = _net()
        net["frozen"] = nn.Linear(3, 3).requires_grad_(False)
        return net, ParamWatch(net, [(n, p) for n, p in net.named_parameters()
                                     if p.requires_grad], "X was built")
    spare = nn.Linear(2, 2)  # made before the watch: attaching it registers no parameter
    net, watch = fresh()
    for _ in range(3):
        watch.check()
    assert walks == []
    watch.check(suspect=True)  # a backward left a bucket short: walk, nothing changed
    assert walks == [1]

    changes = {
        "freeze": lambda n: n["b"].bias.requires_grad_(False),
        "unfreeze": lambda n: n["frozen"].weight.requires_grad_(True),
        "replace": lambda n: setattr(n["a"], "weight", nn.Parameter(torch.randn(5, 7))),
        "attach": lambda n: n.__setitem__("spare", spare),
    }
    for what, change in changes.items():
        net, watch = fresh()
        change(net)
        with pytest.raises(RuntimeError, match="wrap it again"):
            watch.check()
        watch.close()
    # behind torch's back (the dict itself): seen once the old parameter's bucket comes up short
    net, watch = fresh()
    net["a"]._parameters["bias"] = nn.Parameter(torch.zeros(5))
    watch.dirty = False  # the new Parameter's construction registers nothing, but be sure
    watch.check()
    with pytest.raises(RuntimeError, match="wrap it again"):
        watch.check(suspect=True)
    watch.close()


def _direct(rank, world):
    """collectives.sum_async (compressor none's buckets, issued straight to the backend) against
    the plain blocking all-reduce, several in flight at once, ragged sizes, fresh inputs."""
    import torch.distributed as dist

    from pyfast.comm.collectives import sum_async
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(n, generator=g) for n in (1, 37, 4099, 100_003)]
    refs = [x.clone() for x in xs]
    handles = [sum_async(x, None, f"t{i}") for i, x in enumerate(xs)]  # all in flight
    for r in refs:
        dist.all_reduce(r)
    got = [h.wait() for h in handles]
    errors = []
    for bad in (torch.ones(4, dtype=torch.float16), torch.ones(4, 2).t()):
        try:
            sum_async(bad)
        except ValueError as e:
            errors.append(str(e))
    return [torch.equal(a, b) and a is x for a, b, x in zip(got, refs, xs)], errors


def test_sum_async_equals_the_blocking_all_reduce(pool2):
    for same, errors in pool2.run(_direct):
        assert same == [True] * 4, same
        assert len(errors) == 2 and all("float32" in e for e in errors), errors
