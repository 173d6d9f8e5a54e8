"""--batch-split auto's balancer (pyfast.train.rebalance): the pure split function checked by hand,
and the Balancer's window and all-gather on 2 ranks. The job-level run (global batch kept, two
runs equal) is in tests/test_batch_split_auto.py."""
import math

import pytest
import torch

from pyfast.train import rebalance as rb


def test_target_is_speed_proportional_with_largest_remainder_by_hand():
    # 2:1 speed, 12 samples: 8 and 4 exactly
    assert rb.target([1.0, 2.0], 12) == [8, 4]
    # 1 : 1/2 : 1/2 : 1/4 of 16 in units of 2 (8 units): ideal 3.56, 1.78, 1.78, 0.89 units;
    # rank 3 is pinned at one unit, the rest share 7 units as 3.5, 1.75, 1.75 -> floors
    # 3, 1, 1 and the two spare units to the largest remainders (.75, .75: ranks 1 and 2)
    assert rb.target([1.0, 2.0, 2.0, 4.0], 16, unit=2) == [6, 4, 4, 2]
    # equal remainders go to the lower rank: 3 equal ranks, 10 samples
    assert rb.target([1.0, 1.0, 1.0], 10) == [4, 3, 3]
    # a rank 100x slower still gets one sample, and the sum is kept
    assert rb.target([1.0, 100.0], 5) == [4, 1]
    # ragged: 7 samples at speeds 3:2:1 -> ideal 3.5, 2.33, 1.17 -> 3, 2, 1 + the spare to .5
    assert rb.target([1 / 3, 1 / 2, 1.0], 7) == [4, 2, 1]


def test_even_split_and_its_refusals():
    assert rb.even(12, 2) == [6, 6]
    assert rb.even(10, 3) == [4, 3, 3]
    assert rb.even(12, 2, unit=2) == [6, 6]
    assert rb.even(10, 4, unit=2) == [4, 2, 2, 2]
    with pytest.raises(ValueError, match="multiple of the unit 4"):
        rb.even(10, 2, unit=4)
    with pytest.raises(ValueError, match="fewer than 3 ranks"):
        rb.even(4, 3, unit=2)


def test_moves_are_bounded_and_reach_the_target_over_rebalances():
    # 10:1, 12 samples: the target is [11, 1]; MAX_MOVE 0.25 of 12 = 3 samples per rebalance
    secs = [1.0, 10.0]
    assert rb.propose([6, 6], secs, 12) == [9, 3]
    assert rb.propose([9, 3], secs, 12) == [11, 1]
    assert rb.propose([11, 1], secs, 12) == [11, 1]
    # the bound counts samples, in whole units: 2 units of 2 at max_move 0.2 of 20
    assert rb.propose([10, 10], secs, 20, unit=2, max_move=0.2) == [14, 6]
    # a bound under one unit still moves one unit (else auto could never move)
    assert rb.propose([6, 6], secs, 12, max_move=0.01) == [7, 5]
    # 3 ranks: units leave the rank furthest over its target first
    assert rb.bounded([4, 4, 4], [8, 2, 2], 2) == [6, 3, 3]


def test_hysteresis_keeps_the_split_when_the_gain_is_noise():
    # 1.05:1 -> target [6, 6] anyway; 1.15:1 -> target [6, 6]: ideal 6.42 rounds to 6
    assert rb.propose([6, 6], [1.0, 1.05], 12) == [6, 6]
    # near a rounding boundary: at 8 s/sample vs 12.8, [7, 5] and [8, 4] both predict 64 s;
    # from [8, 4] the target [7, 5] (ideal 7.38) gains nothing: no move back
    assert rb.target([8.0, 12.8], 12) == [7, 5]
    assert rb.propose([8, 4], [8.0, 12.8], 12) == [8, 4]
    # [4, 4] at 1 : 1.29 s/sample: the target [5, 3] (ideal 4.5 rounds up) predicts
    # max(5, 3.87) = 5 against max(4, 5.16) = 5.16: a 3.1% gain, below the 5% margin
    assert rb.target([1.0, 1.29], 8) == [5, 3]
    assert rb.propose([4, 4], [1.0, 1.29], 8) == [4, 4]
    assert rb.propose([4, 4], [1.0, 1.29], 8, hysteresis=0.0) == [5, 3]
    # 7 -> 6 predicted when the ranks are equal again: a 14% gain, above the margin
    assert rb.propose([7, 5], [1.0, 1.0], 12) == [6, 6]


def test_missing_measurements_keep_the_split_and_bad_input_is_named():
    assert rb.propose([6, 6], [math.nan, 1.0], 12) == [6, 6]
    assert rb.propose([6, 6], [0.0, 1.0], 12) == [6, 6]
    with pytest.raises(ValueError, match="sums to 11, not the batch 12"):
        rb.propose([6, 5], [1.0, 1.0], 12)
    with pytest.raises(ValueError, match="multiple of 2 samples"):
        rb.propose([7, 5], [1.0, 1.0], 12, unit=2)
    with pytest.raises(ValueError, match="3 measurements for a split over 2 ranks"):
        rb.propose([6, 6], [1.0, 1.0, 1.0], 12)


def test_propose_is_a_pure_function_over_random_cases():
    # every output: sum kept, every rank >= one unit, moved <= the bound, and the same answer
    # twice (every rank computes it independently from the same gathered numbers)
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        n = int(torch.randint(2, 6, (1,), generator=g))
        unit = int(torch.randint(1, 4, (1,), generator=g))
        batch = unit * int(torch.randint(n, 40, (1,), generator=g))
        cur = rb.even(batch, n, unit)
        secs = (torch.rand(n, generator=g, dtype=torch.float64) * 5 + 0.1).tolist()
        for _ in range(4):
            new = rb.propose(cur, secs, batch, unit)
            assert new == rb.propose(cur, secs, batch, unit)
            rb.check_split(new, batch, unit)
            moved = sum(max(a - b, 0) for a, b in zip(cur, new))
            assert moved <= max(unit, unit * math.floor(rb.MAX_MOVE * batch / unit))
            if new != cur:  # a move always shortens the predicted slowest rank by the margin
                assert rb.predicted(new, secs) < (1 - rb.HYSTERESIS) * rb.predicted(cur, secs)
            cur = new


def test_balancer_window_skips_the_first_step_and_takes_the_median():
    b = rb.Balancer([6, 6], 12, 1, dp_rank=0, every=3)
    for t, waited, n in [(99.0, 0.0, 6), (1.2, 0.0, 6), (6.0, 0.0, 6), (1.8, 0.6, 6)]:
        b._t0 = 0.0
        b._now = lambda t=t: t
        b.end(waited, n)
    # step 1 (99 s: warm-up) is skipped; per sample 0.2, 1.0, 0.2 -> median 0.2
    assert b.measured() == pytest.approx(0.2)
    assert math.isnan(rb.Balancer([6, 6], 12, 1, 0).measured())
    with pytest.raises(ValueError, match="--batch-split-every must be >= 1"):
        rb.Balancer([6, 6], 12, 1, 0, every=0)


def _gathered(rank, world, secs_by_rank, dp_of_rank):
    b = rb.Balancer([6, 6], 12, 1, dp_rank=dp_of_rank[rank], every=2)
    b.skip = 0
    b.window = [(0.0, secs_by_rank[rank] * 6, 0.0, 6)]
    assert b.step(1) is None  # not due: no collective
    return b.step(2), b.split, b.last["secs_per_sample"]


@pytest.mark.dist
def test_balancer_all_gathers_and_every_rank_gets_the_same_split(pool2):
    # dp ranks 0 and 1 at 2:1 -> [8, 4] on both ranks
    got = pool2.run(_gathered, [1.0, 2.0], [0, 1], timeout=60)
    assert got[0] == got[1] == ([8, 4], [8, 4], [1.0, 2.0])
