"""compressor="auto"'s decision protocol (pyfast.comm.auto.AutoSelector) with scripted bucket
times: fp16 warm-up, the predicted picks, the picks checked against fp16, then one step of every
bucket uncompressed, kept where it was at least as fast. One process on torch's `fake` group
(world 2: the agreements return this rank's own values)."""
from types import SimpleNamespace

import pytest
import torch

from pyfast.comm.auto import WARMUP, AutoSelector


pytestmark = pytest.mark.usefixtures("fake_world")  # tests/conftest.py


def _buckets(n):
    g = torch.Generator().manual_seed(3)
    return [SimpleNamespace(flat=torch.randn(4096 + 17 * i, generator=g)
                            * torch.exp(torch.randn(4096 + 17 * i, generator=g)),
                            index=i, name=f"bucket{i}") for i in range(n)]


def test_none_is_tried_last_and_kept_where_at_least_as_fast():
    sel = AutoSelector(_buckets(3), None, error_feedback=True)
    for _ in range(WARMUP - 1):
        sel.after_step([9.0, 9.0, 9.0])
        assert sel.choice == ["fp16"] * 3 and not sel.fixed
    sel.after_step([1.0, 1.0, 1.0])  # the fp16 step, timed: the decision follows
    picks = list(sel.choice)
    sel.after_step([0.5, 2.0, 0.8])  # the picks' step: bucket 1's pick (if any) slower than fp16
    assert sel.choice == ["none"] * 3 and not sel.fixed  # the next step tries none everywhere
    assert sel.trial[1] == "fp16" and sel.trial[0] == picks[0]
    sel.after_step([0.6, 0.9, 0.8])  # none: slower for bucket 0, faster for 1, equal for 2
    assert sel.fixed and sel.choice == [picks[0], "none", "none"]
    assert [r["none"] for r in sel.report] == [False, True, True]
    sel.after_step([5.0, 5.0, 5.0])  # fixed: later steps change nothing
    assert sel.choice == [picks[0], "none", "none"]
