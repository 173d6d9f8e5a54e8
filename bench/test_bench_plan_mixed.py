"""`pyfast bench plan_mixed` end to end at its smallest (split from test_bench_plan.py so that
make test's two workers can run it beside plan_time's smoke: each ~25 s)."""
import io

from pyfast import perf


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
