"""`pyfast bench plan` and `plan_time` run end to end on small cases (search: one 10k-plan case;
folklore: one cell; time: two gpt-tiny runs on loopback): they cannot rot."""
import io

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
    assert rows["dp2"]["reference"] and not rows["tp2"]["reference"]
    assert res["summary"]["n"] == 2
    text = io.StringIO()
    perf.show(res, plan_time.table, width=190, file=text)
    assert "tp2" in text.getvalue()


def test_plan_mixed_runs(monkeypatch):
    """`pyfast bench plan_mixed` end to end at its smallest: gpt-tiny, 4 sequences, one run
    per split of WARMUP + 2 steps, the sustained probes 0.3 s, and of calibrate.measure only
    its compute probe (the link, ZeRO and job probes are plan_time's smoke's: ~50 CPU s more
    here). Numbers are not checked (timing on the shared box); that the pipeline runs, the
    TOML plans and the split reaches the job is."""
    import pytest
    from pyfast import hetero
    from pyfast.benchmarks import plan_mixed
    from pyfast.plan import calibrate
    if hetero.available():
        pytest.skip(hetero.available())

    def compute_only(shape, work, cluster, link, plans):
        return cluster.replace(calibration=calibrate.measure_compute(shape, work, plans))
    monkeypatch.setattr(calibrate, "measure", compute_only)
    for k, v in (("MODEL", "gpt-tiny"), ("SEQ", 32), ("BATCH", 4), ("SUSTAIN_S", 0.3),
                 ("STEPS", plan_mixed.WARMUP + 2)):
        monkeypatch.setattr(plan_mixed, k, v)
    res = plan_mixed.run(repeats=1)
    even, split = res["rows"]
    assert even["batch_split"] == [2, 2] and sum(split["batch_split"]) == 4
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in res["rows"])
    assert "[[nodes]]" in res["toml"] and res["speed_ratio"] > 0
    text = io.StringIO()
    perf.show(res, plan_mixed.table, width=190, file=text)
    assert "gain of the uneven split" in text.getvalue()
