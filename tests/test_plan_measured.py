"""pyfast.plan's costs measured on ranks running at once (calibrate_dist): tp's block timed on tp
ranks and ZeRO's per-step costs, and how timing uses them (the loopback traffic they hold is not
counted twice; a slower link adds only its own extra). No speed assertions."""
import ast
import math

import pytest
import torch

from pyfast.comm import cost
from pyfast.plan import calibrate_dist, hardware, timing
from pyfast.plan.spec import ModelShape, Plan, Workload
from pyfast.plan.timing_zero import zero_key

TINY = ModelShape(2, 64, 4, 4, 256, 256, name="gpt-tiny")
WORK = Workload(64, 8, "fp32")


def _cluster(rate_bps=None, free=0.0, **extra):
    """2 cpu ranks with a loopback-like fit (ragged numbers; `free`: the bytes its latency
    covers) and local module timings for every plan below; with a rate, the link shaped by a
    token bucket of 512 KiB (the namespaces')."""
    r = torch.rand(8, dtype=torch.float64).tolist()
    lo = {"fits": {p: [2e-4 + 1e-5 * r[0], 2.5e-10, free] for p in cost.PRIMITIVES},
          "small_s": 1.5e-4, "wake_s": [[1e-4, 5e-5 * (1 + r[1])], [3e-2, 2e-3 * (1 + r[2])]]}
    shaped = dict(lo, tbf=[rate_bps / 8, 512 * 1024]) if rate_bps else lo
    comp = {}
    for plan in (Plan(tp=2, micro_batch=8), Plan(dp=2, micro_batch=4)):
        for kind, s in (("embed", 3e-5), ("block", 9e-4), ("head", 2e-4)):
            comp[timing.compute_key(kind, plan, WORK)] = [s * (1 + r[3]), 2 * s * (1 + r[4])]
    cal = {"link_intra": shaped, "link_inter": shaped, "link_cpu": lo, "compute": comp,
           "optim_s_per_param": 5e-9 * (1 + r[5]), **extra}
    return hardware.Cluster(2, 2, hardware.gpu("cpu"), 1.0, 1.0, calibration=cal)


@pytest.mark.parametrize("free", [0.0, 236e3])  # a probe's fit: 236 KB ride in its latency
@pytest.mark.parametrize("rate", [None, 1e9, 10e6])
def test_tp_block_timed_on_ranks(rate, free):
    plan = Plan(tp=2, micro_batch=8)
    key = timing.compute_key("block", plan, WORK) + ":dist"
    c = _cluster(rate, free)
    plain = timing.predict_time(TINY, plan, WORK, c)
    f, b = 4.1e-3 * (1 + torch.rand(1).item()), 7.3e-3
    c.calibration["compute"][key] = [f, b]
    got = timing.predict_time(TINY, plan, WORK, c)
    # the two blocks' measured seconds replace the local ones (no compute_scale: as cp's)
    lf, lb = c.calibration["compute"][timing.compute_key("block", plan, WORK)]
    assert got["compute_s"] - plain["compute_s"] == pytest.approx(2 * (f + b - lf - lb),
                                                                  rel=1e-9)
    if rate is None:  # loopback: the measured block holds every all-reduce and its wait
        assert got["tp_comm_s"] == 0.0
    else:  # a shaped link: its calls' extra over loopback only, never negative (at 1 Gbit/s
        # the refill covers gpt-tiny's 131 KB calls: none, whatever the loopback fit's free
        # bytes, priced alike on both sides; at 10 Mbit/s they wait for the rate)
        assert 0.0 <= got["tp_comm_s"] < plain["tp_comm_s"]
        assert (got["tp_comm_s"] > 0) == (rate < 1e8)
    # another micro-batch's plan has no timing on ranks: the local block and the modelled calls
    other = timing.predict_time(TINY, Plan(tp=2, micro_batch=4, micro_batches=2), WORK, c)
    assert other["tp_comm_s"] > 0


@pytest.mark.parametrize("stage,m", [(0, 1), (1, 1), (2, 1), (3, 1), (3, 2)])
def test_zero_measured_costs(stage, m):
    # stage 0: DataParallel (its hooks and the last bucket's wait), measured the same way
    plan = Plan(dp=2, zero=stage, micro_batch=4 // m, micro_batches=m)
    fb, st = 2.3e-3 * (1 + torch.rand(1).item()), 9.1e-3
    c = _cluster(zero={zero_key(plan, WORK): [0.0, 0.0]})
    base = timing.predict_time(TINY, plan, WORK, c)
    c.calibration["zero"][zero_key(plan, WORK)] = [fb, st]
    got = timing.predict_time(TINY, plan, WORK, c)
    # on loopback the measured costs are the whole of ZeRO's: forward + backward's once a
    # micro-batch under stage 3 (its gathers), once a step under 1 and 2 (the last backward's
    # reduce-scatters), and the step's; the optimizer is the whole model's (the probe's extra
    # is over a plain step of it)
    assert got["step_s"] - base["step_s"] == pytest.approx(fb * (m if stage == 3 else 1) + st,
                                                           rel=1e-9)
    n = sum(n for _, ps in timing._modules(TINY, plan, 0) for n, _ in ps)
    assert got["optimizer_s"] == pytest.approx(c.calibration["optim_s_per_param"] * n,
                                               rel=1e-9)
    # no measurement for this stage and shape: the model's own arithmetic (under ZeRO a
    # shard's optimizer, half the model's on 2 ranks)
    c.calibration["zero"] = {"zero9:none:b4:s64:fp32": [1.0, 1.0]}
    none = timing.predict_time(TINY, plan, WORK, c)
    assert none["optimizer_s"] == pytest.approx(got["optimizer_s"] / (2 if stage else 1),
                                                rel=1e-9)
    assert none["step_s"] < 1.0



def test_dataparallel_wait_apart_from_its_hooks():
    # stage 0's probe with its third value (DataParallel.last_wait_s): only that wait is
    # exposed, the rest of the extra (the hooks' CPU) is compute, as the job logs them
    plan = Plan(dp=2, micro_batch=4)
    fb, st, wait = 7.7e-3 * (1 + torch.rand(1).item()), 3e-5, 2.9e-3
    c = _cluster(zero={zero_key(plan, WORK): [0.0, 0.0, 0.0]})
    base = timing.predict_time(TINY, plan, WORK, c)
    c.calibration["zero"][zero_key(plan, WORK)] = [fb, st, wait]
    got = timing.predict_time(TINY, plan, WORK, c)
    assert got["step_s"] - base["step_s"] == pytest.approx(fb + st, rel=1e-9)
    assert got["compute_s"] - base["compute_s"] == pytest.approx(fb - wait, rel=1e-9)
    assert got["exposed_comm_s"] - base["exposed_comm_s"] == pytest.approx(wait + st, rel=1e-9)
    # the two-value record (older calibrations): the whole extra is the wait
    c.calibration["zero"][zero_key(plan, WORK)] = [fb, st]
    old = timing.predict_time(TINY, plan, WORK, c)
    assert old["step_s"] == pytest.approx(got["step_s"], rel=1e-9)
    assert old["compute_s"] == pytest.approx(base["compute_s"], rel=1e-9)

@pytest.mark.parametrize("spec", ["int8", "bf16"])
def test_dataparallel_hooks_spread_the_buckets_on_a_slow_link(spec):
    # the hooks' CPU (the probe's extra less its wait) runs inside the backward on the main
    # thread: the buckets come ready later and further apart, so a link slower than loopback
    # adds less wait than behind the backward at its bare length (gpt-small int8 at 1 Gbit/s:
    # +4% to +30% over seven plan_time runs with the hooks after the backward, -11% to +12%
    # with them in it); the hooks never hide more than themselves, and never shorten the step.
    # gpt-small's shape: its 4 MB buckets are 12 (gpt-tiny's one bucket only moves whole)
    small = ModelShape(6, 384, 8, 8, 1536, 256, name="gpt-small")
    plan = Plan(dp=2, micro_batch=4, compress=spec)
    c = _cluster(4e9, zero={zero_key(plan, WORK): [0.0, 0.0, 0.0]})
    st, wait = 2e-5, 1.1e-3 * (1 + torch.rand(1).item())
    got = []
    for hooks in (0.0, 40e-3, 160e-3):
        c.calibration["zero"][zero_key(plan, WORK)] = [wait + hooks, st, wait]
        got.append(timing.predict_time(small, plan, WORK, c))
    exp = [g["exposed_comm_s"] for g in got]
    assert exp[0] > 10e-3  # 4 Gbit/s: 12 buckets of 1 MB int8 / 2 MB bf16 outlast the backward
    for a, b, h in zip(got, got[1:], (40e-3, 120e-3)):
        assert a["exposed_comm_s"] - h - 1e-12 <= b["exposed_comm_s"] <= \
            a["exposed_comm_s"] + 1e-12
        assert b["step_s"] >= a["step_s"] - 1e-12
    assert exp[-1] < 0.5 * exp[0]


@pytest.mark.parametrize("spec", ["powersgd:4", "topk:0.01"])
@pytest.mark.parametrize("rate", [None, 10e6])
def test_per_parameter_compressor_measured_in_dataparallel(spec, rate):
    # top-k / PowerSGD under DataParallel probed as a whole (zero_probe's stage 0): the wait is
    # the probe's, plus only what the link's fits add over loopback's; reduce_seconds' timed
    # calls (the shaped link's alone) no longer enter, so scaling them changes nothing
    plan = Plan(dp=2, micro_batch=4, compress=spec)
    c = _cluster(rate, zero={zero_key(plan, WORK): [0.0, 0.0, 0.0]})
    chain = [1.3e-3 * (1 + torch.rand(1).item()), 2e-8, 4.1e-4]
    for k in ("link_intra", "link_inter"):  # a copy: on loopback link_cpu is the same dict
        c.calibration[k] = dict(c.calibration[k], reduce={spec: chain})
    base = timing.predict_time(TINY, plan, WORK, c)
    fb, st, wait = 36.1e-3 * (1 + torch.rand(1).item()), 2e-5, 33.3e-3
    c.calibration["zero"][zero_key(plan, WORK)] = [fb, st, wait]
    got = timing.predict_time(TINY, plan, WORK, c)
    c.calibration["link_intra"]["reduce"][spec] = [10 * x for x in chain]
    assert timing.predict_time(TINY, plan, WORK, c)["step_s"] == pytest.approx(got["step_s"],
                                                                              rel=1e-12)
    assert got["compute_s"] - base["compute_s"] == pytest.approx(fb - wait, rel=1e-9)
    every = timing.Link(c, 2, 2)  # the step's small all-reduce, exposed beside the wait
    extra = got["exposed_comm_s"] - (wait + st) - every.seconds("small", 32.0) - every.wake(0.0)
    if rate is None:  # loopback: the same fits on both sides, nothing added
        assert extra == pytest.approx(0.0, abs=1e-12)
    else:  # 10 Mbit/s: the payloads wait for the rate, but far less than the timed calls
        assert 0.0 < extra < 29 * chain[0]
    # no DataParallel measurement: the timed calls price the step, and scale it
    c.calibration["zero"] = {}
    one = timing.predict_time(TINY, plan, WORK, c)["step_s"]
    c.calibration["link_intra"]["reduce"][spec] = chain
    assert timing.predict_time(TINY, plan, WORK, c)["step_s"] < one


def test_per_parameter_compressors_probed_alone(monkeypatch):
    # one DataParallel a process for top-k / PowerSGD, as in the job (with the other configs'
    # beside it PowerSGD's wait came out 5 ms long); the dense ones and ZeRO share a probe, a
    # micro-batch each
    calls = []

    def fake(name, args, world, timeout):
        configs = ast.literal_eval(f"({args})")[-1]  # zero_probe's last argument
        calls.append(configs)
        return {f"{st}:{c}": [1e-3, 0.0, 1e-3] for st, c in configs}
    monkeypatch.setattr(calibrate_dist, "_probe", fake)
    work = Workload(16, 4, "fp32")
    plans = [Plan(dp=2, micro_batch=2, compress=c) for c in
             ("none", "powersgd:4", "int8", "topk:0.01", "powersgd:2")] + \
        [Plan(dp=2, zero=2, micro_batch=2), Plan(dp=2, micro_batch=1, compress="powersgd:4")]
    z = calibrate_dist.measure_zero(TINY, work, plans)
    assert sorted(map(sorted, calls)) == sorted(map(sorted, [
        [(0, "none"), (0, "int8"), (2, "none")], [(0, "powersgd:4")], [(0, "topk:0.01")],
        [(0, "powersgd:2")], [(0, "powersgd:4")]]))
    assert set(z) == {zero_key(p, work) for p in plans}


def test_probes_run_on_two_ranks():
    # the probes themselves (2 gloo ranks each, gpt-tiny at 16 tokens): every number finite,
    # keyed as timing reads them
    work = Workload(16, 2, "fp32")
    plans = [Plan(tp=2, micro_batch=2), Plan(dp=2, zero=1, micro_batch=1),
             Plan(dp=2, micro_batch=1, compress="int8"),
             Plan(dp=2, micro_batch=1, compress="topk:0.01")]  # DataParallel's, probed too
    tp = calibrate_dist.measure_tp_blocks(TINY, work, plans)
    z = calibrate_dist.measure_zero(TINY, work, plans)
    assert list(tp) == [timing.compute_key("block", plans[0], work) + ":dist"]
    assert list(z) == [zero_key(p, work) for p in plans[1:]]
    f, b = tp[list(tp)[0]]
    assert f > 0 and b > 0
    assert all(math.isfinite(x) for v in z.values() for x in v)
