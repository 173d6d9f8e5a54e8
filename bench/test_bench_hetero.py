"""`pyfast bench hetero` runs end to end on gpt-tiny (2 timed steps, rank 1 capped at half a
CPU): every configuration gives a row, auto's split keeps the global batch, the cap bit, and the
table renders. No speed is asserted (a smoke test)."""
import io

import pytest

from pyfast import hetero, perf
from pyfast.benchmarks import hetero as bench


@pytest.mark.skipif(bool(hetero.available()), reason=hetero.available() or "")
def test_hetero_bench_runs():
    res = bench.run(model="gpt-tiny", seq=16, batch=6, steps=1, warmup=2, every=1,
                    fixed=("4,2",))
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == ["even", "auto", "fixed:4,2", "fast alone"]
    assert all(r["samples_s"] > 0 for r in rows.values())
    assert all(sum(s) == 6 and min(s) >= 1 for s in rows["auto"]["splits"])
    assert rows["fixed:4,2"]["splits"] == [[4, 2]] * 3 and rows["fast alone"]["batch"] == 4
    assert res["throttled_periods"][0] is None and res["throttled_periods"][1][1] > 0
    text = io.StringIO()
    perf.show(res, bench.table, file=text)
    assert "auto >= 1.3 x even" in text.getvalue()
