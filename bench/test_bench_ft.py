"""Smoke suite for `pyfast bench ft` (pyfast.benchmarks.ft): the harness once, tiny and untimed
(gpt-tiny, seq 32, batch 4, 2 groups, a kill once step 5 is logged, torchrun's checkpoint every 2), on
loopback, so that it cannot rot: every field of a repeat, never a speed. The numbers
docs/fault_tolerance.md quotes come from `pyfast bench ft` itself."""
import math

from pyfast.benchmarks import ft


def test_cost_and_both_recoveries_are_measured():
    res = ft.run("gpt-tiny", 2, 4, 32, steps=14, kill_at=5, ckpt_every=2, heartbeat_ms=500,
                 repeats=1, link="loopback", cost_steps=5, timeout=600)
    (row,) = res["rows"]
    assert row["ft_step_ms"] > 0 and row["plain_step_ms"] > 0
    assert math.isclose(row["ratio"], row["ft_step_ms"] / row["plain_step_ms"])
    f, t = row["ft"], row["torchrun"]
    # the survivor went on alone after the death
    assert f["participants_after"] == 1 and f["death_to_survivor_step_s"] > 0
    assert f["survivor_steps_lost"] >= 0 and f["survivor_failed_commits"] >= 0
    # the restarted group logged a committed step after the death (healed or, past the
    # survivor's end at gpt-tiny's speed, on its own: both are reported as they are)
    assert f["restart_s"] is not None and f["restart_s"] > 0
    # torchrun: the checkpoint at step 4, one step lost (at least), back at step 6 after it
    assert t["ckpt_step"] == 4 and t["steps_lost"] == 1
    assert 0 < t["first_step_after_restart_s"] <= t["back_s"]
    assert "cost --ft" in ft.table(res)
