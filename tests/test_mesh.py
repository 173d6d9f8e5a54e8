"""Mesh: Megatron's rank order on torch's DeviceMesh, checked against the layout by hand."""
import pytest
import torch.distributed as dist

from dist_utils import RankError, run_ranks
from pyfast.parallel import Mesh

LAYOUTS = [(4, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4), (1, 4, 1)]  # dp, tp, pp


def _layouts(rank, world):
    out = []
    for dp, tp, pp in LAYOUTS:
        m = Mesh(dp=dp, tp=tp, pp=pp)
        out.append({"coords": (m.dp_rank, m.tp_rank, m.pp_rank), "str": str(m),
                    "groups": {k: dist.get_process_group_ranks(getattr(m, f"{k}_group"))
                               for k in ("dp", "tp", "pp")}})
    return out


@pytest.mark.dist
def test_rank_order_and_groups_at_4_ranks():
    got = run_ranks(_layouts, 4)
    for i, (dp, tp, pp) in enumerate(LAYOUTS):
        for r in range(4):
            want = ((r // tp) % dp, r % tp, r // (dp * tp))  # tp innermost, then dp, then pp
            g = got[r][i]
            assert g["coords"] == want, (dp, tp, pp, r)
            # each group is the ranks that share the other two coordinates
            every = {q: ((q // tp) % dp, q % tp, q // (dp * tp)) for q in range(4)}
            for k, axis in (("dp", 0), ("tp", 1), ("pp", 2)):
                same = sorted(q for q, c in every.items()
                              if all(c[a] == want[a] for a in range(3) if a != axis))
                assert g["groups"][k] == same, (k, dp, tp, pp, r)
            assert f"dp={dp}, tp={tp}, pp={pp}" in g["str"] and f"rank {r}/4" in g["str"]


def _bad(rank, world, dp, tp, pp):
    Mesh(dp=dp, tp=tp, pp=pp)


@pytest.mark.dist
@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (3, 1, 1), (1, 1, 1)])
def test_wrong_product_names_the_numbers(dp, tp, pp):
    errors = run_ranks(_bad, 2, dp, tp, pp, expect_errors=True)
    for e in errors:
        assert isinstance(e, RankError) and e.kind == "ValueError"
        assert f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp}" in e.message
        assert "world size is 2" in e.message


def _bad_degree(rank, world):
    Mesh(dp=0, tp=2, pp=1)


@pytest.mark.dist
def test_degree_must_be_positive_int():
    for e in run_ranks(_bad_degree, 2, expect_errors=True):
        assert e.kind == "ValueError" and "dp must be an int >= 1, got 0" in e.message


def _sub(rank, world):
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    m = Mesh(dp=1, tp=2, pp=1, group=mine)
    return (m.rank, m.world, m.tp_rank, dist.get_process_group_ranks(m.tp_group))


@pytest.mark.dist
def test_mesh_over_a_subgroup():
    got = run_ranks(_sub, 4)
    assert got == [(0, 2, 0, [0, 1]), (1, 2, 1, [0, 1]), (0, 2, 0, [2, 3]), (1, 2, 1, [2, 3])]
