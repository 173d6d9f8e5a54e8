"""The DDP-semantics cost benchmark runs (one round, one step): it cannot rot."""
from pyfast.benchmarks import dp_semantics


def test_dp_semantics_runs():
    res = dp_semantics.run(specs=("none",), rounds=1, steps=1)
    row = res["rows"]["none"]
    assert all(row[v] > 0 for v in dp_semantics.VARIANTS)
    assert row["max_param_diff"] == 0  # every variant computed what the bare DataParallel did
    assert "%" in dp_semantics.table(res)
