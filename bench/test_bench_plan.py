"""`pyfast bench plan` and `plan_time` run end to end on small cases (search: one 10k-plan case;
folklore: one cell; time: two gpt-tiny configurations on loopback, each run twice): they cannot
rot. plan_mixed's smoke is in test_bench_plan_mixed.py (a file of its own: make test's workers
take whole files)."""
import io

import pytest

from pyfast import perf
from pyfast.benchmarks import plan, plan_time


def test_plan_search_and_folklore_run(monkeypatch):
    # the smallest case that still scores 10,000+ configurations: gpt-7b on 16 GPUs (2 nodes,
    # so the inter-node link is in it) scores 15,721, where SEARCH_CASES' 512-GPU cases score
    # ~73,000 each at ~0.4 ms a configuration (bench/results/plan_search.json): ~6 CPU s
    # instead of ~27 on the 2-core VM
    monkeypatch.setattr(plan, "SEARCH_CASES", (("gpt-7b", 16, 4096, 2048),))
    res = plan.run_search(1)
    (row,) = res["rows"]
    assert row["configurations"] >= 10_000 and row["median_s"] > 0
    monkeypatch.setattr(plan, "SIZES", ("7b",))
    monkeypatch.setattr(plan, "GPU_COUNTS", (8,))
    monkeypatch.setattr(plan, "LINKS", ("400gbit",))
    fk = plan.run_folklore("gpt")
    (cell,) = fk["rows"]
    # 7B with AdamW (16 bytes a parameter: 100 GiB) fits 8 x 80 GB only sharded or split
    assert cell["plan"] is not None and cell["memory_bytes"] <= 81559 * 2**20
    assert cell["fields"]["dp"] * cell["fields"]["cp"] < 8 or cell["fields"]["zero"] >= 1
    text = io.StringIO()
    perf.show(fk, plan.folklore_table, width=240, file=text)
    assert "7B" in text.getvalue()
    assert "| 7B | 8 |" in plan.markdown(fk)


def test_plan_time_runs(monkeypatch):
    # 6 steps a run, not the benchmark's 50 (a median for the page): 3 warm-up steps and 3
    # measured are all the rows below need; 2 x 44 gpt-tiny steps fewer (~22 ms each here)
    monkeypatch.setattr(plan_time, "STEPS", {**plan_time.STEPS, "gpt-tiny": plan_time.WARMUP + 3})
    res = plan_time.run([("loopback", "gpt-tiny", "dp2"), ("loopback", "gpt-tiny", "tp2")])
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"dp2", "tp2"}
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows.values())
    # PASSES runs a configuration; the pooled median lies between the runs' own medians
    assert all(len(r["passes_s"]) == plan_time.PASSES and
               min(r["passes_s"]) <= r["measured_s"] <= max(r["passes_s"]) for r in rows.values())
    assert rows["dp2"]["reference"] and not rows["tp2"]["reference"]
    assert res["summary"]["n"] == 2
    text = io.StringIO()
    perf.show(res, plan_time.table, width=190, file=text)
    assert "tp2" in text.getvalue()


def test_plan_time_pools_a_configurations_runs():
    """pooled(): the median over every run's steps after WARMUP (a slow second run moves the
    row halfway, not all the way), each run's own median kept; runs of different plans refused."""
    w = plan_time.WARMUP

    def run(ms, plan=None):
        recs = [{"step_ms": 99.0, "exposed_comm_ms": 9.0}] * w + \
            [{"step_ms": m, "exposed_comm_ms": m / 10} for m in ms]
        return {"config": "dp2", "plan": plan or {"dp": 2}, "wall_s": 1.5, "records": recs,
                "measured_s": sorted(ms)[len(ms) // 2] / 1e3}
    row = plan_time.pooled([run([10.0, 11.0, 12.0]), run([20.0, 21.0, 22.0])])
    assert row["measured_s"] == pytest.approx(0.016) and row["passes_s"] == [0.011, 0.021]
    assert row["exposed_s"] == pytest.approx(0.0016) and row["wall_s"] == 3.0
    assert len(row["records"]) == 6  # the warm-up steps of both runs left out
    with pytest.raises(RuntimeError, match="different plans"):
        plan_time.pooled([run([10.0]), run([10.0], {"dp": 1})])


def test_plan_time_scale_comes_from_the_reference_on_its_own_link(monkeypatch):
    """A (link, model) group with its own reference run refits on it; one without takes
    loopback's scale as fitted there (never refitted against another link's calibration: that
    put gpt-small's 1 Gbit/s int8 run 15-28% slow in five runs); with neither, no scale."""
    from pyfast.plan import hardware
    refits = []

    def refit(cluster, shape, plan, work, records, skip, comm):
        refits.append((records, comm))
        return cluster.replace(calibration=dict(cluster.calibration, compute_scale=records))
    monkeypatch.setattr(plan_time.calibrate, "refit_records", refit)
    base = hardware.Cluster(2, 2, hardware.gpu("cpu"), 1.0, 1.0, calibration={"x": 1})
    ref = {"link": "loopback", "model": "gpt-small", "config": "dp2", "shape": None,
           "plan": {}, "records": 0.93, "measured_s": 0.25, "exposed_s": 0.03}
    rows = [ref, {"link": "1gbit", "model": "gpt-small", "config": "dp2 int8"}]
    scales = {}
    cl, got = plan_time.with_scale(base, "loopback", "gpt-small", rows, scales, None)
    assert got is ref and cl.calibration["compute_scale"] == 0.93 and refits == [(0.93, False)]
    cl, got = plan_time.with_scale(base, "1gbit", "gpt-small", rows, scales, None)
    assert got is None and cl.calibration == {"x": 1, "compute_scale": 0.93}
    assert len(refits) == 1  # not refitted
    cl, got = plan_time.with_scale(base, "1gbit", "gpt-tiny", rows, scales, None)
    assert got is None and cl.calibration == {"x": 1}
    # a reference run that mostly waited (its compute the rest of a long wait) is not fitted
    # on: its link takes loopback's scale; one that waited less than half is
    for exposed, fitted in ((0.060, False), (0.040, True)):
        slow = {"link": "100mbit", "model": "gpt-small", "config": "dp2", "shape": None,
                "plan": {}, "records": 1.4, "measured_s": 0.1, "exposed_s": exposed}
        refits.clear()
        cl, got = plan_time.with_scale(base, "100mbit", "gpt-small", rows + [slow], scales,
                                       None)
        assert (got is slow) == fitted and len(refits) == fitted
        assert cl.calibration["compute_scale"] == (1.4 if fitted else 0.93)
