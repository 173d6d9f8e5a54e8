"""Smoke suite for `pyfast bench diloco` (pyfast.benchmarks.diloco): the harness once, tiny and
untimed (gpt-tiny, seq 32, batch 8, 20 steps, on a 1 Gbit/s namespace link: dp bf16, DiLoCo
H10 and Streaming int4), so that it cannot rot: every row's curve, bytes and columns, never a
speed. The numbers docs/diloco.md quotes come from `pyfast bench diloco` itself."""
import math

import pytest

from pyfast.benchmarks import diloco, netns


@pytest.fixture(scope="module")
def result():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    return diloco.run(("1gbit",), ("gpt-tiny",), ("dp bf16", "diloco H10", "streaming int4"),
                      sizes={"gpt-tiny": (32, 8, 40, 20)}, timeout=300)


def test_every_row_has_its_curve_bytes_and_times(result):
    rows = {r["config"]: r for r in result["rows"]}
    assert sorted(rows) == ["diloco H10", "dp bf16", "streaming int4"]
    for name, r in rows.items():
        assert [s for s, _, _ in r["curve"]] == [20, 40], r["curve"]
        assert all(math.isfinite(v) and 0 < v < 10 for _, _, v in r["curve"])
        assert r["tokens"] == 40 * 8 * 32 and r["train_s"] > 0 and 0 < r["utilization"] <= 1
        assert r["wire_bytes"] > 0 and r["peak_Bps"] > 0 and r["need_Bps"] > 0, r
    assert rows["dp bf16"]["outer_syncs"] == 0
    assert rows["diloco H10"]["outer_syncs"] == 4  # steps 10, 20, 30, 40
    assert rows["streaming int4"]["outer_syncs"] == 4  # H 40 in 4 fragments: steps 10..40
    # the same tokens, and DiLoCo's whole-model syncs move less than dp's 40 reductions: fp32
    # outer gradients every 10 steps are 2/10 of bf16 every step, plus the per-step scalars
    assert rows["diloco H10"]["wire_bytes"] < 0.5 * rows["dp bf16"]["wire_bytes"]
    # int4 fragments: a quarter of the model at 1/8 of fp32 per sync
    assert rows["streaming int4"]["max_step_bytes"] < rows["diloco H10"]["max_step_bytes"] / 16


def test_time_to_reference_and_table(result):
    ref = next(r for r in result["rows"] if r["config"] == "dp bf16")
    assert ref["time_to_target_s"] == ref["curve"][-1][1] and ref["speedup"] == pytest.approx(1)
    for r in result["rows"]:
        assert r["target_val"] == ref["final_val"]
        assert r["val_vs_ref"] == pytest.approx(r["final_val"] / ref["final_val"] - 1)
    from rich.console import Console
    console = Console(width=200)
    with console.capture() as cap:
        console.print(diloco.table(result))
    assert "streaming int4" in cap.get()
