"""`pyfast bench cp` runs end to end on a tiny problem (one repeat, loopback): it cannot rot."""
import io

from pyfast import perf
from pyfast.benchmarks import cp


def test_cp_bench_runs():
    # head_dim 64: a shard of 64 KB, over the memory launch's mmap threshold (smaller tensors
    # reuse heap pages already resident, and the peak can be 0)
    res = cp.run(lengths=(256,), links=("loopback",), repeats=1, heads=2, head_dim=64,
                 log=lambda *a: None, loop_calls=4)
    rows = {(r["link"], r["provider"]): r for r in res["rows"]}
    assert set(rows) == {("-", p) for p in cp.ONE} | {("loopback", p) for p in cp.PROVIDERS}
    assert all(r["median_s"] > 0 and r["vs_1_thread"] > 0 for r in rows.values())
    # the correctness gate ran on every 2-rank provider and passed
    assert set(res["gate"]["loopback"]) == set(cp.PROVIDERS)
    assert all(e <= cp.TOL["fp32"] for e in res["gate"]["loopback"].values())
    for p in cp.PROVIDERS:
        r = rows[("loopback", p)]
        assert r["peak_bytes"] > 0 and r["peak_vs_one"] > 0
        assert r["input_bytes"] * 2 == rows[("-", cp.ONE1)]["input_bytes"]
        if p.startswith("ring"):
            assert r["comm_alone_s"] > 0 and r["exposed_s"] >= 0 and "hidden" in r
    assert rows[("loopback", "ring zigzag")]["zigzag_speedup"] > 0
    assert {t["target"].split(":")[0] for t in res["targets"]} >= {"loopback", "ring zigzag"}
    text = io.StringIO()
    perf.show(res, cp.table, width=220, file=text)
    assert "ring contiguous" in text.getvalue() and "correctness gate" in text.getvalue()
    # the training loop's row: cached and per-call agreement timed side by side, both methods
    loop = {r["provider"]: r for r in res["loop"]}
    assert set(loop) == {p for p in cp.PROVIDERS if p.endswith("zigzag")}
    assert all(r["cached_s"] > 0 and r["uncached_s"] > 0 and r["calls"] == 4
               and abs(r["ratio"] - r["uncached_s"] / r["cached_s"]) < 1e-12
               for r in loop.values())
    assert "training loop" in text.getvalue()
