"""pyfast.plan.timing (the step-time model, pure arithmetic) and pyfast.plan.calibrate's
compute measurement and refit, on gpt-tiny. No speed assertions: timings are machine's."""
import dataclasses
import json
import math

import pytest
import torch

import pyfast.compress as C
from pyfast.comm import cost
from pyfast.plan import calibrate, hardware, timing
from pyfast.plan.spec import ModelShape, Plan, Workload

TINY = ModelShape(2, 64, 4, 4, 256, 256, name="gpt-tiny")
SMALL = ModelShape(6, 384, 8, 8, 1536, 256, name="gpt-small")


def cluster(inter="400gbit", gpus=16, per_node=8, gpu="h100", **kw):
    return hardware.Cluster(gpus, per_node, hardware.gpu(gpu), hardware.gpu(gpu).intra_bps,
                            hardware.parse_bandwidth(inter), **kw)


@pytest.mark.parametrize("schedule,divisor", [("gpipe", 1), ("1f1b", 1),
                                              ("interleaved-1f1b", 2), ("zb-h1", 3)])
def test_bubble_per_schedule(schedule, divisor):
    # 8 layers over 4 stages: the slowest stage (the head's) sets both the compute and the
    # bubble, so bubble / compute = (p - 1) / (m x virtual stages), zb-h1 a third of 1f1b's
    # (backward split into input and weight gradients, each ~ one forward: ZB-H1's
    # (p-1)(F+B-W) against (p-1)(F+B+W))
    shape = ModelShape(8, 256, 4, 4, 1024, 256)
    m = 7
    plan = Plan(pp=4, micro_batch=2, micro_batches=m, schedule=schedule)
    out = timing.predict_time(shape, plan, Workload(128, 14, "bf16"), cluster(gpus=4))
    assert plan.virtual_stages == (2 if schedule == "interleaved-1f1b" else 1)
    assert out["bubble_s"] / out["compute_s"] == pytest.approx(3 / (m * divisor), rel=1e-9)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_ring_all_reduce_bytes(world):
    # no latency: an uncalibrated link's all-reduce of n bytes is the ring's
    # 2 (W-1)/W n bytes at the link's rate, the bytes cost.sent_bytes counts for it
    c = cluster(per_node=world, gpus=world).replace(intra_latency_s=0.0)
    link = timing.Link(c, world, world)
    n = 1000 + 37 * world  # ragged: not a multiple of W
    want = cost.sent_bytes(C.get("none"), n, world) / c.intra_bps
    assert link.seconds("all_reduce", 4.0 * n) == pytest.approx(want, rel=1e-3)  # sent_bytes rounds


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4", "fp8"])
def test_dense_payload_matches_compressor(spec):
    # timing's per-element wire bytes (no torch at prediction time) against the compressor's
    n = 5 * 512 + 311
    assert timing.DENSE_BYTES[spec] * n == pytest.approx(C.get(spec).wire_bytes(n), abs=4.0)


def test_compression_cuts_dp_time_on_a_slow_link_and_costs_steps():
    c = cluster(inter="1gbit", gpus=16, per_node=1)  # every dp peer on another node
    work = Workload(1024, 64, "bf16")
    pred = {s: timing.predict_time(SMALL, Plan(dp=16, micro_batch=4, compress=s), work, c)
            for s in ("none", "bf16", "int8", "topk:0.01", "powersgd:4")}
    for s in ("bf16", "int8", "topk:0.01", "powersgd:4"):
        assert pred[s]["dp_comm_s"] < pred["none"]["dp_comm_s"], s
        assert pred[s]["steps_factor"] > 1.0, s
    assert pred["none"]["steps_factor"] == 1.0
    assert pred["int8"]["dp_comm_s"] < pred["bf16"]["dp_comm_s"]
    assert pred["int8"]["steps_factor"] < pred["topk:0.01"]["steps_factor"]
    with pytest.raises(ValueError, match="no relative error known"):
        timing.steps_factor("zstd")


def test_relative_errors_of_the_table_are_the_compressors():
    # the table's bf16/fp16/int8 against cost.relative_error on a gradient-like tensor: within
    # 2x (int8's 0.013 is gpt-tiny's heavier-tailed gradients; a Gaussian gives ~0.008)
    x = torch.randn(3 * 512 + 77) * torch.rand(1) * 1e-2
    for spec in ("bf16", "fp16", "int8"):
        got = cost.relative_error(C.get(spec), x)
        assert 0.5 <= timing.rel_error(spec) / got <= 2.0, (spec, got)
    assert timing.STEPS_PER_ERROR == cost.STEPS_PER_ERROR


@pytest.mark.parametrize("plan", [Plan(dp=8, micro_batch=2, micro_batches=2),
                                  Plan(dp=4, tp=2, micro_batch=4, compress="int8"),
                                  Plan(dp=2, pp=4, micro_batch=2, micro_batches=8),
                                  Plan(dp=4, cp=2, micro_batch=4),
                                  Plan(dp=8, zero=3, micro_batch=2, micro_batches=2)])
def test_more_bandwidth_is_never_slower(plan):
    work = Workload(2048, 32, "bf16")
    prev = math.inf
    for bw in ("100mbit", "1gbit", "10gbit", "100gbit", "400gbit"):
        step = timing.predict_time(SMALL, plan, work, cluster(inter=bw, per_node=2))["step_s"]
        assert step <= prev * (1 + 1e-12), bw
        prev = step


def test_predict_keys_and_speed_of_arithmetic():
    out = timing.predict_time(SMALL, Plan(dp=16, micro_batch=4), Workload(1024, 64), cluster())
    for k in ("step_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s", "recompute_s",
              "codec_s", "tokens_per_s", "steps_factor", "optimizer_s", "dp_comm_s", "why"):
        assert k in out
    assert out["tokens_per_s"] == pytest.approx(1024 * 64 / out["step_s"])
    ck = timing.predict_time(SMALL, Plan(dp=16, micro_batch=4, activation_checkpointing=True),
                             Workload(1024, 64), cluster())
    assert ck["recompute_s"] > 0 and ck["step_s"] > out["step_s"]


def _fake_run(tmp_path, shape_flag="gpt-tiny"):
    """A run directory as `pyfast train` leaves it: a checkpoint's meta.json with the run's
    flags (the shard files only as placeholders) and metrics.jsonl written by the test."""
    from pyfast.train.config import TrainConfig
    cfg = TrainConfig(model=shape_flag, dp=2, seq=64, batch=8, steps=6, out=str(tmp_path))
    d = tmp_path / "checkpoints" / "step-6"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": 6, "model_key": cfg.model_key(),
                                             "vocab_size": 256,
                                             "config": dataclasses.asdict(cfg)}))
    (d / ".metadata").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    return cfg


def test_calibrate_and_refit_on_gpt_tiny(tmp_path):
    cfg = _fake_run(tmp_path)
    shape, plan, work, _ = calibrate.run_plan(tmp_path)
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (2, 64, 4, 256)
    assert (plan.dp, plan.micro_batch, plan.micro_batches, work.seq) == (2, 4, 1, 64)
    base = hardware.Cluster(2, 2, hardware.gpu("cpu"), 1e9, 1e9)
    cal = calibrate.measure_compute(shape, work, [plan])
    for kind in ("embed", "block", "head"):
        f, b = cal["compute"][timing.compute_key(kind, plan, work)]
        assert f > 0 and b > 0, kind
    c = base.replace(calibration=cal)
    pred = timing.predict_time(shape, plan, work, c)
    comp = pred["step_s"] - pred["exposed_comm_s"]
    assert pred["exposed_comm_s"] > 0
    # a run that computed 1.7x and waited 2.3x what the model predicts, after 2 warm-up steps
    # whose numbers must not count
    recs = [{"step": i + 1, "compute_ms": 1e3 * comp * (9.0 if i < 2 else 1.7 + 0.01 * i),
             "exposed_comm_ms": 1e3 * pred["exposed_comm_s"] * (9.0 if i < 2 else 2.3),
             "step_ms": 0.0, "bytes_sent": 0} for i in range(7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fit = calibrate.refit(c, tmp_path)
    # medians over steps 3..7: 1.7 + 0.01 x (2..6) -> 1.74
    assert fit.calibration["compute_scale"] == pytest.approx(1.74, rel=1e-9)
    assert fit.calibration["comm_scale"] == pytest.approx(2.3, rel=1e-9)
    again = calibrate.refit(fit, tmp_path)  # refit drops the old scales first: same answer
    assert again.calibration["compute_scale"] == pytest.approx(1.74, rel=1e-9)
    assert cfg.model == "gpt-tiny"


def test_refit_without_steps_is_an_error(tmp_path):
    _fake_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "compute_ms": 1.0,
                                                        "exposed_comm_ms": 1.0}) + "\n")
    c = hardware.Cluster(2, 2, hardware.gpu("cpu"), 1e9, 1e9)
    with pytest.raises(ValueError, match="no steps after the first 2"):
        calibrate.refit(c, tmp_path)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        calibrate.refit(c, tmp_path / "nothing")


def _tbf_cluster(rate_bps: float | None):
    """2 ranks on this machine's cpu "GPU" with a loopback-like link fit (alpha 0.2 ms, 4 GB/s,
    no free bytes) and, with a rate, that link shaped by a token bucket of 512 KiB."""
    lo = {"fits": {p: [2e-4, 2.5e-10, 0.0] for p in cost.PRIMITIVES}, "small_s": 1.5e-4,
          "wake_s": [[1e-4, 5e-5], [3e-3, 2e-3]]}
    shaped = dict(lo, fits={p: [9e-4, 1.6e-7, 1e5] for p in cost.PRIMITIVES})  # ignored: tbf
    if rate_bps is not None:
        shaped["tbf"] = [rate_bps / 8, 512 * 1024]
    cal = {"link_intra": shaped, "link_inter": shaped, "link_cpu": lo}
    return hardware.Cluster(2, 2, hardware.gpu("cpu"), 1.0, 1.0, calibration=cal)


def test_token_bucket_rate_bound_step_is_its_bytes_at_the_rate():
    # gpt-tiny tp2 (8 all-reduces of 8 x 64 tokens x 64 x 4 B = 131 KB a step, 262 KB each on
    # the shared qdisc): at 10 Mbit/s every call's share of the refill is below its bytes, so
    # the fluid bucket's step is the step's bytes / rate exactly (the tokens gained while the
    # step waits are the bytes it sends), whatever the compute and latencies are
    work, plan = Workload(64, 8, "fp32"), Plan(tp=2, micro_batch=8)
    step = timing.predict_time(TINY, plan, work, _tbf_cluster(10e6))["step_s"]
    wire = 8 * 2 * (8 * 64 * 64 * 4)
    assert step == pytest.approx(wire / (10e6 / 8), rel=1e-9)
    # an unshaped-fast bucket (its share of the refill covers every call): the loopback fit's
    # step, bit for bit the same arithmetic (no free bytes in it)
    fast = timing.predict_time(TINY, plan, work, _tbf_cluster(1e15))["step_s"]
    lo = _tbf_cluster(None)
    lo.calibration["link_intra"] = lo.calibration["link_inter"] = lo.calibration["link_cpu"]
    assert fast == pytest.approx(timing.predict_time(TINY, plan, work, lo)["step_s"], rel=1e-12)


def test_token_bucket_small_messages_pass_within_the_refill_big_ones_wait():
    work = Workload(64, 8, "fp32")
    # 8 transfers of 2 x 64 x 64 x 4 = 32 KB, and a 1 KB header each way in two of them
    pp = Plan(pp=2, micro_batch=2, micro_batches=4)
    lo = _tbf_cluster(None)
    lo.calibration["link_intra"] = lo.calibration["link_inter"] = lo.calibration["link_cpu"]
    free = timing.predict_time(TINY, pp, work, lo)["step_s"]
    # the refill a call gets, rate x free step / 8 calls, is >= 32 KB + 256 B (the headers
    # spread over the calls) from 8 x 32 KB + 2 KB a step (in bits/s: x 8) on
    rate = (8 * 32768 + 2048) / free * 8
    for r, slower in ((rate * 1.01, False), (rate * 0.5, True)):
        got = timing.predict_time(TINY, pp, work, _tbf_cluster(r))["step_s"]
        assert (got > free * (1 + 1e-9)) == slower, r
    # one call above the 512 KiB burst pays its excess at the rate however long the step is
    link = timing.Link(_tbf_cluster(8e9), 2, 2)
    link.refill = math.inf
    n = 400_000  # a 2-rank all-reduce: 800 KB on the qdisc, 275,712 B beyond the burst
    assert link.seconds("all_reduce", n) == pytest.approx(
        2e-4 + 2.5e-10 * n + (2 * n - 512 * 1024) / 1e9, rel=1e-12)


@pytest.mark.parametrize("spec", ["topk:0.01", "powersgd:4"])
def test_per_parameter_calls_take_the_measured_call(spec):
    # calibrate.reduce_seconds' fit of one whole per-parameter call (a + b x elements) replaces
    # the latency fit + codec for top-k / PowerSGD: DataParallel's dp_comm_s is its sum over
    # gpt-tiny's parameters, one call each (29 of ragged sizes: 64 .. 64 x 256)
    c = _tbf_cluster(None)
    a, b, v = 1.3e-3 + 1e-4 * torch.rand(1).item(), 2e-8, 9e-4
    c.calibration["link_intra"] = c.calibration["link_inter"] = dict(
        c.calibration["link_cpu"], reduce={spec: [a, b, v]})
    plan = Plan(dp=2, micro_batch=4, compress=spec)
    got = timing.predict_time(TINY, plan, Workload(64, 8, "fp32"), c)["dp_comm_s"]
    params = [(n, m) for _, ps in timing._modules(TINY, plan, 0) for n, m in ps]
    assert len(params) > 20
    # PowerSGD all-reduces vectors (biases, norms) uncompressed: their own measured call
    want = sum(a + b * n if m or spec.startswith("topk") else v for n, m in params)
    assert got == pytest.approx(want, rel=1e-12)
    # another compressor's fit is not this one's: the latency model prices it
    c.calibration["link_intra"] = c.calibration["link_inter"] = dict(
        c.calibration["link_cpu"], reduce={"topk:0.5": [a, b, v]})
    other = timing.predict_time(TINY, plan, Workload(64, 8, "fp32"), c)["dp_comm_s"]
    assert other != pytest.approx(got, rel=1e-3)


def test_a_checkpointed_cp_block_recomputes_every_ring_steps_attention():
    """Full recompute reruns a block's whole forward: under cp that is every ring step's
    attention, not only the local causal block's (what the model left out until the published
    CP 4 / 8 runs showed it: predicted 16-61% fast). No cp: the local block only, as before."""
    from pyfast.plan.timing_compute import _module_s, _modules, attention_s
    shape, work, cl = ModelShape(4, 4096, 32, 8, 14336, 128256, name="llama-ish"), \
        Workload(131072, 1, "bf16"), cluster(gpus=8)
    for cp in (1, 4):
        plan = Plan(dp=8 // cp, cp=cp, zero=3, activation_checkpointing=True)
        params = dict(_modules(shape, plan, 0))["block"]
        f, b, rec = _module_s("block", params, shape, plan, work, cl)
        own, off = attention_s(shape, plan, work, cl)
        assert (off > 0) == (cp > 1)
        assert math.isclose(rec, f + off, rel_tol=1e-9), (cp, f, off, rec)
        plain = _module_s("block", params, shape, dataclasses.replace(
            plan, activation_checkpointing=False), work, cl)
        assert plain[2] == 0.0 and plain[:2] == (f, b)


def test_pipeline_runtime_cost_is_measured_and_added_per_micro_batch():
    """calibrate_dist.measure_pp times pyfast's Pipeline on 2 gloo ranks (its own cost a
    micro-batch beyond compute and waits); timing adds m x v of it to a pp plan's step, and
    nothing where it was not measured (a GPU cluster's table has none)."""
    from pyfast.plan.calibrate_dist import measure_pp
    plan = Plan(pp=2, micro_batches=4, micro_batch=2)
    got = measure_pp([plan, Plan(dp=2, micro_batch=2)])
    assert list(got) == [timing.pp_key(plan)] and 0.0 < got[timing.pp_key(plan)] < 0.1, got
    work = Workload(256, 8, "bf16")
    for v, sched in ((1, "1f1b"), (2, "interleaved-1f1b")):
        p = dataclasses.replace(plan, schedule=sched, micro_batches=4 * v)
        base = timing.predict_time(SMALL, p, work, cluster())["step_s"]
        cl = cluster(calibration={"pp": {timing.pp_key(p): 1e-3}})
        assert math.isclose(timing.predict_time(SMALL, p, work, cl)["step_s"] - base,
                            p.micro_batches * p.virtual_stages * 1e-3, rel_tol=1e-6)


@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-small"])
@pytest.mark.parametrize("spec", ["none", "int8", "bf16", "topk:0.01"])
def test_reduction_buckets_are_dataparallels(model, spec):
    # the model's buckets are the job's, element for element: sizes by the job's defaults,
    # reverse registration order, each parameter at a multiple of the compressor's block
    # (int8's 512 pads gpt-tiny's 132,864 elements to 140,288: its vectors are 64-256 long)
    from pyfast import models
    from pyfast.comm.buckets import Bucketer, default_bucket_mb
    from pyfast.plan import shapes
    m = models.build(model, 256, 64)
    c = C.get(spec)
    real = Bucketer(list(m.named_parameters()), default_bucket_mb(spec), lambda *a: None,
                    align=c.block)
    mods = timing._modules(shapes.preset(model), Plan(dp=2, micro_batch=4, compress=spec), 0)
    got = timing.dp_buckets(mods, spec)
    if spec == "topk:0.01":  # one call a parameter (DataParallel's per-tensor compressors)
        assert [b[0] for b in got] == [p.numel() for p in reversed(list(m.parameters()))]
    else:
        assert [b[0] for b in got] == [b.flat.numel() for b in real.buckets]
    assert sum(n for b in got for n, _ in b[1]) == sum(p.numel() for p in m.parameters())


def test_quantizer_blocks_are_the_compressors():
    # sharding.BLOCKED / QUANT_BLOCK mirror pyfast.compress (the planner imports no torch)
    from pyfast.plan.sharding import BLOCKED, QUANT_BLOCK
    from pyfast.plan.timing_reduce import DENSE_BYTES
    for name in [*DENSE_BYTES, "none", "topk:0.01", "powersgd:4"]:
        want = QUANT_BLOCK if name.partition(":")[0] in BLOCKED else 1
        assert want == C.get(name).block, name
