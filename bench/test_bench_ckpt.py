"""`pyfast bench ckpt` runs end to end on gpt-tiny (one round, one checkpoint a segment, both
async executors): it cannot rot, and its checkpoints load back equal (run() raises if not)."""
import io

from pyfast import perf
from pyfast.benchmarks import ckpt


def test_ckpt_bench_runs():
    res = ckpt.run(model="gpt-tiny", every=2, checkpoints=1, rounds=1, batch=2, seq=16,
                   executors=("thread", "process"))
    assert [r["config"] for r in res["rows"]] == ["none", "blocking", "async thread",
                                                  "async process"]
    assert all(r["step_s"] > 0 for r in res["rows"]) and res["roundtrip_max_diff"] == 0.0
    rows = {r["config"]: r for r in res["rows"]}
    assert rows["none"]["added_per_ckpt_s"] == 0.0 and "blocked_ms" not in rows["none"]
    for name in ("blocking", "async thread", "async process"):
        assert rows[name]["blocked_ms"] > 0, name
    for name in ("async thread", "async process"):  # the background write was timed
        assert rows[name]["write_ms"] > 0 and rows[name]["stage_ms"] > 0, name
    assert res["ckpt_bytes"] > 0
    text = io.StringIO()
    perf.show(res, ckpt.table, file=text)
    assert "async thread" in text.getvalue() and "x blocking's added" in text.getvalue()
