"""Smoke suite for `pyfast bench diloco` (pyfast.benchmarks.diloco): the harness once, tiny and
untimed (gpt-tiny, seq 32, batch 8, N = 40 steps, on a 1 Gbit/s namespace link: dp bf16 and
Streaming int4: a DiLoCo row and the reference are what the harness treats differently; plain
DiLoCo H10, a third launch of ~30 s here, is the same harness path with other flags, its
training tested in tests/test_train_diloco.py), so that it cannot rot: every row's curve, bytes
and columns, never a speed. The numbers docs/diloco.md quotes come from `pyfast bench diloco` itself."""
import math

import pytest

from pyfast.benchmarks import diloco, netns


@pytest.fixture(scope="module")
def result():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    return diloco.run(("1gbit",), ("gpt-tiny",), ("dp bf16", "streaming int4"),
                      sizes={"gpt-tiny": (32, 8, 40, 20)}, timeout=300)


def test_every_row_has_its_curve_bytes_and_times(result):
    rows = {r["config"]: r for r in result["rows"]}
    assert sorted(rows) == ["dp bf16", "streaming int4"]
    ref = rows["dp bf16"]
    assert [s for s, _, _ in ref["curve"]] == [20, 40] and ref["tokens"] == 40 * 8 * 32
    for name, r in rows.items():
        steps = [s for s, _, _ in r["curve"]]
        # DiLoCo runs on (up to LONGER x 40 steps) until they reach dp bf16's final loss
        assert steps == list(range(20, steps[-1] + 1, 20)) and 40 <= steps[-1] <= 40 * \
            diloco.LONGER, (name, steps)
        reached = r["curve"][-1][2] <= ref["final_val"]
        assert name == "dp bf16" or reached or steps[-1] == 40 * diloco.LONGER, r["curve"]
        assert all(math.isfinite(v) and 0 < v < 10 for _, _, v in r["curve"])
        assert r["val_at_n"] == r["curve"][1][2]  # the validation at step N = 40
        assert r["train_s"] > 0 and 0 < r["utilization"] <= 1
        assert r["wire_bytes"] > 0 and r["peak_Bps"] > 0 and r["need_Bps"] > 0, r
        # a run stopped at dp's loss leaves no rank training on into the next config's timing
        assert r["left_running"] == 0, (name, r["left_running"])
    assert ref["outer_syncs"] == 0
    # H 40 in 4 fragments: a sync every 10 steps
    assert rows["streaming int4"]["outer_syncs"] == rows["streaming int4"]["steps"] // 10
    # per step, int4 fragments every 10 steps move far less than dp's bf16 every step
    # (gpt-small at 100 Mbit/s: 0.015 of dp's bytes a step, bench/results/diloco.json)
    per = {n: r["wire_bytes"] / r["steps"] for n, r in rows.items()}
    assert per["streaming int4"] < 0.1 * per["dp bf16"]
    # its largest step, a fragment's sync (a quarter of the model in int4), against dp's step
    # (all of it in bf16): 0.094 of it on gpt-small; a quarter bounds it with the scalars
    assert rows["streaming int4"]["max_step_bytes"] < rows["dp bf16"]["max_step_bytes"] / 4


def test_time_to_reference_and_table(result):
    ref = next(r for r in result["rows"] if r["config"] == "dp bf16")
    assert ref["time_to_target_s"] == ref["curve"][-1][1] and ref["speedup"] == pytest.approx(1)
    for r in result["rows"]:
        assert r["target_val"] == ref["final_val"]
        assert r["val_vs_ref"] == pytest.approx(r["val_at_n"] / ref["final_val"] - 1)
    from rich.console import Console
    console = Console(width=200)
    with console.capture() as cap:
        console.print(diloco.table(result))
    assert "streaming int4" in cap.get()


def test_crossings_end_at_the_time_to_target(result):
    """The last crossing (dp bf16's final loss) is the main table's speed-up; every other is
    the same rule against an earlier dp validation."""
    rows = {r["config"]: r for r in result["rows"]}
    cross = diloco.crossings(result)
    assert [n for _, _, n, _, _ in cross] == [s for s, _, _ in rows["dp bf16"]["curve"]]
    last = cross[-1][4]
    for name in ("streaming int4",):
        assert last[name] == (pytest.approx(rows[name]["speedup"]) if rows[name]["speedup"]
                              else None)
    for _, _, n, v, ups in cross:
        t_ref = next(t for s, t, _ in rows["dp bf16"]["curve"] if s == n)
        for name, up in ups.items():
            hit = next((t for _, t, w in rows[name]["curve"] if w <= v), None)
            assert up == (t_ref / hit if hit else None)


def test_schedules_and_a_reference_from_an_earlier_run():
    """dp's cosine ends at N, DiLoCo's at K N (K = 1: the same schedule); constant keeps the
    old warm-up-then-flat rate. An earlier run's dp bf16 row stands in for measuring it again
    only when its sizes and schedule are this run's."""
    assert diloco.schedule_flags("constant", 200, 2.5, True) == ["--warmup", "20",
                                                                 "--min-lr-ratio", "1"]
    assert diloco.schedule_flags("cosine", 200, 2.5, True)[-2:] == ["--lr-decay-steps", "500"]
    assert diloco.schedule_flags("cosine", 200, 2.5, False)[-1] == "200"
    with pytest.raises(ValueError, match="--lr-schedule 'linear'"):
        diloco.schedule_flags("linear", 200, 1, True)
    old = {"rows": [{"config": "dp bf16", "link": "100mbit", "model": "gpt-small",
                     "final_val": 2.35}], "sizes": {"gpt-small": [128, 8, 200, 20]},
           "schedule": "cosine", "date": "2026-11-28T18:30:00"}
    row = diloco._reference(old, "100mbit", "gpt-small", (128, 8, 200, 20), "cosine")
    assert row["final_val"] == 2.35 and row["measured"] == old["date"]
    with pytest.raises(ValueError, match="lr schedule"):
        diloco._reference(old, "100mbit", "gpt-small", (128, 8, 200, 20), "constant")
    with pytest.raises(ValueError, match="no dp bf16 row for 1gbit"):
        diloco._reference(old, "1gbit", "gpt-small", (128, 8, 200, 20), "cosine")


def test_a_stopped_run_leaves_no_rank_behind(tmp_path):
    """_stop (a run at dp's loss) ends the ranks too: torchrun starts each in its own session,
    out of reach of a SIGKILL to the launcher's group (the bug: a stopped run trained on
    through the next config's timing)."""
    import os
    import subprocess
    import sys
    import time
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "pyfast", "train", "--nproc", "2", "--model", "gpt-tiny",
           "--seq", "32", "--batch", "8", "--steps", "100000", "--dp", "2", "--no-tensorboard",
           "--out", out]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, t0 = os.path.join(out, "metrics.jsonl"), time.monotonic()
    try:
        while not diloco._read(metrics):  # the ranks are up and stepping
            assert p.poll() is None and time.monotonic() - t0 < 600, "the run did not start"
            time.sleep(0.2)
        assert len(diloco._ranks_of(out)) >= 3  # the launcher and its two ranks
        diloco._stop(p)
        assert diloco._ranks_of(out) == []
    finally:
        for q in diloco._ranks_of(out):
            os.kill(q, 9)
