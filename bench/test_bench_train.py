"""Smoke suite for `pyfast bench train` (pyfast.benchmarks.train): the harness once, tiny and
untimed (gpt-tiny, global batch 4, seq 32, one step, plain loopback), so that it cannot rot.
Every provider must produce a finite step time, and every 2-rank provider's first-step loss must
have matched the dense model's (the harness refuses to time one that does not). The numbers
docs/benchmarks.md quotes come from `pyfast bench train` itself (bench/results/train*.txt).
"""
import math

import pytest

from pyfast.benchmarks import train


@pytest.fixture(scope="module")
def result():
    return train.run(("loopback",), train.CONFIGS, batch=4, steps=1, warmup=0,
                     model="gpt-tiny", seq=32, timeout=120)


def test_every_provider_timed(result):
    rows = {r["config"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(train.CONFIGS)
    for name, r in rows.items():
        assert "error" not in r, r
        assert math.isfinite(r["median_s"]) and r["median_s"] > 0, r
        assert r["tokens_s"] == pytest.approx(4 * 32 / r["median_s"])


def test_first_step_matches_dense(result):
    for r in result["rows"]:
        assert abs(r["loss1"] - r["ref_loss"]) <= train.TOL, r
        if not ("int8" in r["config"] or "bf16" in r["config"]):
            assert r["grad_norm1"] == pytest.approx(r["ref_grad_norm"], rel=1e-3), r


def test_targets_and_table(result):
    names = {t["target"] for t in result["targets"]}
    assert "(1) dp2 >= 0.8 x 2 x 1proc x 1thr (loopback)" in names
    assert all(t["met"] == (t["ratio"] >= t["need"]) for t in result["targets"])
    from rich.console import Console
    console = Console(width=170)
    with console.capture() as cap:
        console.print(train.table(result))
    assert "torch pipelining" in cap.get() and "targets" in cap.get()


def test_unavailable_link_is_a_skip_row(monkeypatch):
    from pyfast.benchmarks import netns
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    res = train.run(("1gbit",), ["pyfast dp2", "torch DDP"], batch=4, steps=1, warmup=0,
                    model="gpt-tiny", seq=32)
    assert res["rows"] == [{"link": "1gbit", "skipped": netns.unavailable()}]
    assert res["targets"] == []


def test_uneven_batch_is_a_row_not_a_crash():
    assert train._fits("pyfast pp2", 2) and train._fits("torch DDP", 3)
    assert train._fits("pyfast tp2", 3) is None
