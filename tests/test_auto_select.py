"""compressor="auto"'s decision protocol (pyfast.comm.auto.AutoSelector) with scripted bucket
and step times: fp16 warm-up, one step of every bucket uncompressed; "none" everywhere when
halving the bytes did not make the step faster or little of it was exposed, else the predicted picks, then each bucket's
fastest of its pick, fp16 and none as measured. One process on torch's `fake` group (world 2:
the agreements return this rank's own values)."""
from types import SimpleNamespace

import pytest
import torch

from pyfast.comm import auto
from pyfast.comm.auto import WARMUP, AutoSelector

pytestmark = pytest.mark.usefixtures("fake_world")  # tests/conftest.py


def _buckets(n):
    g = torch.Generator().manual_seed(3)
    return [SimpleNamespace(flat=torch.randn(4096 + 17 * i, generator=g)
                            * torch.exp(torch.randn(4096 + 17 * i, generator=g)),
                            index=i, name=f"bucket{i}") for i in range(n)]


@pytest.fixture
def steps(monkeypatch):
    """Scripted whole-step times: steps.append(seconds) before each after_step."""
    now, lengths = [0.0], []

    def clock(device=None):
        now[0] += lengths.pop(0) if lengths else 0.0
        return now[0]
    monkeypatch.setattr(auto, "clock", clock)
    return lengths


def _warm(sel, steps, step_s):
    for _ in range(WARMUP - 1):
        steps.append(9.0)
        sel.after_step([9.0, 9.0, 9.0])
        assert sel.choice == ["fp16"] * 3 and not sel.fixed
    steps.append(step_s)
    sel.after_step([1.0, 1.0, 1.0])  # the fp16 step, timed: none everywhere next
    assert sel.choice == ["none"] * 3 and not sel.fixed


def test_none_everywhere_when_halving_the_bytes_did_not_pay(steps, monkeypatch):
    sel = AutoSelector(_buckets(3), None, error_feedback=True)
    monkeypatch.setattr(sel, "_decide", lambda: pytest.fail("no codec is timed"))
    _warm(sel, steps, 1.0)
    steps.append(1.05)  # uncompressed 5% slower than 16-bit: within MARGIN's 10%
    sel.after_step([2.0, 0.5, 1.0])  # even where a bucket's own reduction was slower
    assert sel.fixed and sel.choice == ["none"] * 3
    assert [r["choice"] for r in sel.report] == ["none"] * 3
    steps.append(5.0)
    sel.after_step([5.0, 5.0, 5.0])  # fixed: later steps change nothing
    assert sel.choice == ["none"] * 3


def test_none_everywhere_when_little_of_the_step_was_exposed(steps, monkeypatch):
    sel = AutoSelector(_buckets(3), None, error_feedback=True)
    monkeypatch.setattr(sel, "_decide", lambda: pytest.fail("no codec is timed"))
    _warm(sel, steps, 1.0)
    steps.append(2.0)  # the 16-bit step looked twice as fast (noise, on a loaded machine) ...
    sel.after_step([0.5, 3.0, 1.0], lambda: 0.19)  # ... but under 10% of the step was exposed
    assert sel.fixed and sel.choice == ["none"] * 3
    assert "190.0 of it exposed" in sel.report[0]["why"]


def test_picks_then_the_fastest_measured(steps):
    sel = AutoSelector(_buckets(3), None, error_feedback=True)
    _warm(sel, steps, 1.0)
    steps.append(2.0)  # uncompressed took twice the 16-bit step: the link matters
    sel.after_step([0.5, 3.0, 1.0], lambda: 0.2)  # none: bucket 0 faster than fp16, 1 slower,
    assert not sel.fixed  # 2 equal; 10% of the step exposed: a codec may pay
    picks = list(sel.choice)
    assert all(r["pick"] == p for r, p in zip(sel.report, picks))
    steps.append(1.0)
    sel.after_step([0.4, 2.0, 0.7])  # the picks' step
    assert sel.fixed
    # bucket 0: its pick's 0.4 < none's 0.5 < fp16's 1.0; bucket 1: fp16's 1.0 beats its pick's
    # 2.0 unless the pick was fp16 (then measured again: 2.0 against none's 3.0); bucket 2:
    # the pick's 0.7 beats fp16's and none's 1.0
    assert sel.choice[0] == picks[0] and sel.choice[2] == picks[2]
    assert sel.choice[1] == "fp16"
    assert sel.report[1]["reverted"] == (picks[1] != "fp16")


def test_state_round_trip_and_an_old_mid_decision_state(steps):
    sel = AutoSelector(_buckets(3), None, error_feedback=True)
    _warm(sel, steps, 1.0)
    steps.append(1.0)
    sel.after_step([1.0, 1.0, 1.0])
    other = AutoSelector(_buckets(3), None, error_feedback=True)
    other.load_state_dict(sel.state_dict())
    assert other.fixed and other.choice == ["none"] * 3 and other.step == sel.step
    # saved before issue 32 between its steps (no "tnone"): the decision starts over
    old = {**sel.state_dict(), "fixed": False, "step": 3, "trial": ["int8"] * 3}
    del old["tnone"]
    fresh = AutoSelector(_buckets(3), None, error_feedback=True)
    fresh.load_state_dict(old)
    assert not fresh.fixed and fresh.step == 0 and fresh.choice == ["fp16"] * 3
    with pytest.raises(ValueError, match="has 3 buckets, this DataParallel has 2"):
        AutoSelector(_buckets(2), None, True).load_state_dict(sel.state_dict())
