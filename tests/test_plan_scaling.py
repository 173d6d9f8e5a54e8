"""`pyfast plan --scaling` and the cost flags (pyfast/plan/scaling.py, cost.py, cli_scale.py):
efficiency, its loss split and the dollars checked by hand, the JSON fields, the cluster file's
price keys, bad input. Pure Python (no ranks)."""
import json
import math

import pytest

from pyfast.plan import cost, scaling as S
from pyfast.plan.cluster import build
from plan_utils import plan

TINY = ["--model", "gpt-tiny", "--gpu", "cpu", "--seq", "64", "--global-batch", "8",
        "--precision", "fp32"]


def _t(step, exposed=0.0, bubble=0.0, recompute=0.0, optimizer=0.0, factor=1.0):
    return {"step_s": step, "exposed_comm_s": exposed, "bubble_s": bubble,
            "recompute_s": recompute, "optimizer_s": optimizer, "steps_factor": factor}


def test_efficiency_and_its_loss_by_hand():
    # base: 8 GPUs, a 10 s step of 1e6 tokens: c0 = 10 x 8 / 1e6 = 8e-5 GPU-s a token, of it
    # exposed comm 1 x 8 / 1e6 = 8e-6, optimizer 8e-6, rest (10 - 2) x 8 / 1e6 = 6.4e-5
    base = S.per_token(_t(10, exposed=1, optimizer=1), 8, 1e6)
    assert base == pytest.approx({"exposed_comm": 8e-6, "bubble": 0, "recompute": 0,
                                  "optimizer": 8e-6, "extra_steps": 0, "rest": 6.4e-5})
    # 16 GPUs, a 6 s step: c = 6 x 16 / 1e6 = 9.6e-5, efficiency 8e-5 / 9.6e-5 = 0.8333;
    # exposed 2 x 16e-6 = 3.2e-5 -> (3.2e-5 - 8e-6) / 9.6e-5 = 0.25; bubble 0.5 x 16e-6 = 8e-6
    # -> 0.0833; optimizer 1.6e-5 -> (1.6e-5 - 8e-6) / 9.6e-5 = 0.0833; rest (6 - 3.5) x 16e-6
    # = 4e-5 -> (4e-5 - 6.4e-5) / 9.6e-5 = -0.25 (a gain); the sum 0.1667 = 1 - 0.8333
    p = S.point(_t(6, exposed=2, bubble=0.5, optimizer=1), 16, 1e6, base)
    assert p["efficiency"] == pytest.approx(8e-5 / 9.6e-5)
    assert p["loss"] == pytest.approx({"exposed_comm": 0.25, "bubble": 1 / 12, "recompute": 0,
                                       "optimizer": 1 / 12, "extra_steps": 0, "rest": -0.25})
    assert sum(p["loss"].values()) == pytest.approx(1 - p["efficiency"])
    # a compressor's 10% more steps: c = 6 x 1.1 x 16 / 1e6 = 1.056e-4, efficiency 0.7576,
    # extra steps 0.1 x 6 x 16 / 1e6 = 9.6e-6 of it: 9.6e-6 / 1.056e-4 = 0.0909
    p = S.point(_t(6, exposed=2, bubble=0.5, optimizer=1, factor=1.1), 16, 1e6, base)
    assert p["efficiency"] == pytest.approx(8e-5 / 1.056e-4)
    assert p["loss"]["extra_steps"] == pytest.approx(9.6e-6 / 1.056e-4)
    assert sum(p["loss"].values()) == pytest.approx(1 - p["efficiency"])
    # weak: 2x the GPUs, 2x the batch, the same 10 s step: per-GPU throughput kept, 100%
    assert S.point(_t(10, exposed=1, optimizer=1), 16, 2e6, base)["efficiency"] == \
        pytest.approx(1.0)
    assert S.weak_batch(256, 8, 24) == 768 and S.weak_batch(3, 2, 3) is None


def test_cost_by_hand():
    # $2.49 a GPU-hour x 16 GPUs = $39.84 an hour = $0.011067 a second
    h = cost.hourly(build(16, 8, "h100"), 2.49)
    assert h == pytest.approx(39.84)
    # a 6 s step of 1e6 tokens: $0.0664 a step; 166,667 tokens/s: 6,000 s a billion tokens
    # = $66.40; 10% more steps: $73.04; 2e12 tokens x 1.1 / 166,667 = 1.32e7 s = 3,666.7 h,
    # x $39.84 = $146,080
    c = cost.plan_cost(_t(6), 1e6, h)
    assert c["per_step"] == pytest.approx(0.0664) and c["to_budget"] is None
    assert c["per_billion_tokens"] == pytest.approx(66.40)
    c = cost.plan_cost(_t(6, factor=1.1), 1e6, h, 2e12)
    assert c["per_billion_tokens"] == pytest.approx(73.04)
    assert c["hours_to_budget"] == pytest.approx(3666.667, rel=1e-6)
    assert c["to_budget"] == pytest.approx(146080.0)
    # spot at 60% off: $2.49 x 0.4 = $0.996 a GPU-hour
    assert cost.gpu_hour(build(16, 8, "h100").gpu, 2.49, 0.6) == pytest.approx(0.996)
    assert cost.money(146080.0) == "$146,080" and cost.money(0.0664) == "$0.0664"
    assert cost.hours(3666.667) == "152.8 days" and cost.hours(1.5) == "1.5 h"


def test_price_keys_of_the_cluster_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('gpus = 16\ngpus_per_node = 8\nprice = 3.0\nspot_discount = 0.5\n'
                 '[gpu]\nbase = "h100"\nprice = 2.0\n')
    cl = build(cluster_file=str(f))
    # the GPU type's price over the top level's; the top level's discount where it has none
    assert (cl.gpu.price, cl.gpu.spot_discount) == (2.0, 0.5)
    assert cost.hourly(cl) == 32.0 and cost.hourly(cl, spot=True) == 16.0
    assert cost.hourly(cl, price=4.0) == 64.0            # --price over the file
    assert cost.hourly(cl, spot=0.75) == 8.0             # --spot D over the file's
    f.write_text('gpus = 8\nprice = 3.0\n')
    assert build(cluster_file=str(f), gpu_name="a100-80gb").gpu.price == 3.0  # --gpu kept it
    assert cost.hourly(build(8, 8, "h100")) is None      # no price anywhere: no cost


@pytest.mark.parametrize("toml,message", [
    ("gpus = 8\nprice = 0\n", "price is dollars per GPU-hour, a number > 0; got 0"),
    ("gpus = 8\nprice = nan\n", "price is dollars per GPU-hour"),
    ("gpus = 8\nprice = \"cheap\"\n", "got 'cheap'"),
    ("gpus = 8\nspot_discount = 1.0\n", "spot_discount is the fraction off the price, in [0, 1)"),
    ("gpus = 8\n[gpu]\nbase = \"h100\"\nspot_discount = -0.1\n", "[gpu]: spot_discount"),
    ("gpus = 8\n[gpu]\nbase = \"h100\"\nprize = 2\n", "unknown keys ['prize']"),
])
def test_bad_price_keys(tmp_path, toml, message):
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ValueError) as e:
        build(cluster_file=str(f))
    assert message in str(e.value)


def test_scaling_json_checked_by_hand(capsys):
    rc, out, err = plan(TINY + ["--scaling", "1,2", "--price", "2", "--tokens", "1e9",
                                "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    rows = d["scaling"]
    assert [r["gpus"] for r in rows] == [1, 2]
    assert [r["weak"]["global_batch"] for r in rows] == [8, 16]   # 8 x gpus / 1
    for r in rows:
        assert set(r) >= {"gpus", "global_batch", "step_s", "tokens_per_s", "efficiency",
                          "loss", "weak_efficiency", "weak", "plan", "cost", "steps_factor"}
        assert set(r["loss"]) == set(S.PARTS)
        assert r["plan"]["dp"] * r["plan"]["cp"] * r["plan"]["tp"] * r["plan"]["pp"] == r["gpus"]
        assert r["plan"]["step_s"] == r["step_s"] and r["global_batch"] == 8
        assert r["tokens_per_s"] == pytest.approx(8 * 64 / r["step_s"])
        # efficiency by hand: (step_1 x factor_1 x 1 / tokens) / (step_n x factor_n x n / tokens)
        b = rows[0]
        assert r["efficiency"] == pytest.approx(
            b["step_s"] * b["steps_factor"] / (r["step_s"] * r["steps_factor"] * r["gpus"]))
        assert sum(r["loss"].values()) == pytest.approx(1 - r["efficiency"], abs=1e-12)
        # $2 a GPU-hour x n GPUs: per step = 2 n x step / 3600; a billion tokens = 2 n x
        # factor x 1e9 / tokens_per_s / 3600; to 1e9 tokens the same (the budget is 1e9)
        c = r["cost"]
        assert c["per_step"] == pytest.approx(2 * r["gpus"] * r["step_s"] / 3600)
        assert c["per_billion_tokens"] == pytest.approx(
            2 * r["gpus"] * r["steps_factor"] * 1e9 / r["tokens_per_s"] / 3600)
        assert c["to_budget"] == pytest.approx(c["per_billion_tokens"])
        assert c["hours_to_budget"] == pytest.approx(
            r["steps_factor"] * 1e9 / r["tokens_per_s"] / 3600)
    assert rows[0]["efficiency"] == 1.0 and rows[0]["weak_efficiency"] == 1.0
    assert {d["cheapest"]["gpus"], d["fastest"]["gpus"]} <= {1, 2}
    assert d["cheapest"]["cost"]["per_billion_tokens"] == min(
        r["cost"]["per_billion_tokens"] for r in rows)
    # and the text: the table, and the cheapest / fastest side by side
    rc, out, err = plan(TINY + ["--scaling", "1,2", "--price", "2"], capsys)
    assert rc == 0, err
    assert "strong eff" in out and "cheapest" in out and "fastest" in out


def test_plans_gain_a_cost(capsys):
    rc, out, err = plan(TINY + ["--gpus", "2", "--price", "2.5", "--spot", "0.6", "--json"],
                        capsys)
    assert rc == 0, err
    for p in json.loads(out)["plans"]:
        # $2.5 x 0.4 = $1 a GPU-hour, 2 GPUs
        assert p["cost"]["per_step"] == pytest.approx(2 * p["step_s"] / 3600)
        assert p["cost"]["to_budget"] is None
    # (no price: the keys as before, test_plan_cli's KEYS)


@pytest.mark.parametrize("extra,message", [
    (["--scaling", "0,2"], "GPU counts must be >= 1, got [0]"),
    (["--scaling", "4,2"], "must be increasing, without repeats (4 then 2)"),
    (["--scaling", "2,2"], "(2 then 2)"),
    (["--scaling", "2,x"], "comma-separated integers"),
    (["--scaling", "8,12"], "[12] span several nodes but are not a multiple of "
                            "--gpus-per-node 8"),
    (["--scaling", "2,4", "--gpus", "4"], "leave out --gpus"),
    (["--scaling", "2,4", "--verify"], "--verify with --scaling"),
    (["--gpus", "2", "--price", "0"], "--price is dollars per GPU-hour, a number > 0; got 0.0"),
    (["--gpus", "2", "--price", "nan"], "got nan"),
    (["--gpus", "2", "--price", "2", "--spot", "1"], "--spot is the fraction off the price"),
    (["--gpus", "2", "--price", "2", "--spot"], "--spot: no spot discount for cpu"),
    (["--gpus", "2", "--spot", "0.5"], "--spot without a price"),
    (["--gpus", "2", "--price", "2", "--tokens", "0"], "--tokens is a token budget"),
    (["--scaling", "1,2", "--tokens", "1e9"], "give --price"),
    (["--gpus", "2", "--tokens", "1e9"], "--tokens 1e+09: give --price"),
])
def test_bad_input(extra, message, capsys):
    rc, out, err = plan(TINY + extra, capsys)
    assert rc == 2 and message in err, err


def test_counts_that_fit_no_plan_are_rows_saying_so():
    calls = []

    class Best:
        time = dict(_t(1.0), tokens_per_s=128.0)

    def best(n, gb):
        calls.append((n, gb))
        return (None, "nothing fits") if n == 1 else (Best, None)
    rows = S.scale([1, 2, 4], 8, lambda gb: gb * 16, best)
    assert rows[0]["efficiency"] is None and rows[0]["reason"] == "nothing fits"
    # the base is the first count with a plan (2): weak batches grow from it, 8 x 4 / 2 = 16
    assert rows[1]["efficiency"] == 1.0 and rows[2]["weak"]["global_batch"] == 16
    assert math.isclose(rows[2]["efficiency"], 0.5)   # the same step on twice the GPUs
    assert (4, 16) in calls


def test_a_two_rank_link_fit_grown_to_four_ranks():
    # a link fitted on 2 ranks (calibrate_link's probes): all-reduce = a + b x bytes. On 4 ranks
    # the ring takes 2(4-1) = 6 steps, not 2 (a x 3), and moves 2(4-1)/4 = 1.5 n a rank, not
    # n (b x 1.5); all-gather receives 3 contributions, not 1 (a x 3, b x 3); 2 ranks: as fitted
    from pyfast.plan.timing_link import Link
    fit = {"fits": {"all_reduce": [1e-3, 1e-9, 0.0], "all_gather": [2e-3, 2e-9, 0.0]},
           "small_s": 1e-4}
    cl = build(4, 4, "cpu").replace(calibration={"link_intra": fit, "link_inter": fit})
    n = 1e6
    assert Link(cl, 2, 2).seconds("all_reduce", n) == pytest.approx(1e-3 + 1e-3)
    assert Link(cl, 4, 4).seconds("all_reduce", n) == pytest.approx(3e-3 + 1.5e-3)
    assert Link(cl, 4, 4).seconds("all_gather", n) == pytest.approx(6e-3 + 6e-3)
    assert Link(cl, 4, 4).seconds("small", 16) == pytest.approx(3e-4)
    assert Link(cl, 4, 4).seconds("p2p", n) == pytest.approx(1e-3 + 0.5e-3)


def test_bench_scaling_smoke(monkeypatch):
    # `pyfast bench scaling`'s arithmetic and table without its runs: measured steps of
    # 0.4 s (1 rank), 0.3 s (2), 0.5 s (4), the planner uncalibrated (no probes)
    from pyfast.benchmarks import scaling as B
    from pyfast.plan import calibrate, shapes
    from pyfast.plan.spec import Plan, Workload
    steps = {1: 0.4, 2: 0.3, 4: 0.5}

    def run(link, ranks, compress, model, n):
        recs = [{"step_ms": steps[ranks] * 1e3, "compute_ms": steps[ranks] * 900,
                 "exposed_comm_ms": steps[ranks] * 100}] * n
        return {"link": link, "ranks": ranks, "compress": compress if ranks > 1 else "-",
                "measured_s": steps[ranks], "q10_s": steps[ranks], "q90_s": steps[ranks],
                "exposed_s": 0.0, "wall_s": 0.0, "records": recs,
                "plan": Plan(dp=ranks, micro_batch=8 // ranks, compress=compress
                             if ranks > 1 else "none").fields(),
                "shape": shapes.preset("gpt-tiny"), "work": Workload(64, 8, "fp32")}
    monkeypatch.setattr(B, "measure_run", run)
    monkeypatch.setattr(calibrate, "measure", lambda shape, work, base, *a: base)
    monkeypatch.setattr(B, "cores", lambda: 2)
    res = B.run(["loopback"], ["none"], (1, 2, 4), "gpt-tiny", 5)
    r = {x["ranks"]: x for x in res["rows"]}
    # efficiency = T1 / (N x TN): 0.4 / (2 x 0.3) = 66.7%, 0.4 / (4 x 0.5) = 20%
    assert r[2]["measured_eff"] == pytest.approx(0.4 / 0.6)
    assert r[4]["measured_eff"] == pytest.approx(0.2)
    assert r[1]["predicted_eff"] == r[1]["predicted_eff_fit"] == 1.0
    for x in r.values():
        assert x["points"] == pytest.approx(100 * (x["predicted_eff"] - x["measured_eff"]))
    # the fit: T_N predicted with the 2-rank run's compute scale, against the measured T_1
    assert r[2]["reference"] and not r[4]["reference"]
    assert r[4]["predicted_eff_fit"] == pytest.approx(0.4 / (4 * r[4]["predicted_s_fit"]))
    assert res["points_n"] == 2 and res["points_n_fit"] == 1 and "records" not in r[1]
    # 4 one-thread ranks on 2 cores: compute (and loopback's CPU-bound link) twice as slow
    cl = B.cluster_for(build(2, 2, "cpu"), 4)
    assert cl.calibration["compute_scale"] == 2.0 and cl.calibration["comm_scale"] == 2.0
    assert "comm_scale" not in B.cluster_for(build(2, 2, "cpu"), 4, "1gbit").calibration
    assert "strong scaling" in str(B.table(res).renderables[0].title)
