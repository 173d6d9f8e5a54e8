"""Mesh: Megatron's rank order (and cp) on torch's DeviceMesh, checked against the layout
by hand."""
import pytest
import torch.distributed as dist

from dist_utils import RankError, run_ranks
from pyfast.parallel import Mesh

LAYOUTS = [(4, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4), (1, 4, 1)]  # dp, tp, pp
CP_LAYOUTS = [(2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2), (1, 4, 1, 1)]  # dp, cp, tp, pp


def _groups(m, names):
    return {k: dist.get_process_group_ranks(getattr(m, f"{k}_group")) for k in names}


def _layouts(rank, world):
    out = []
    for dp, tp, pp in LAYOUTS:
        m = Mesh(dp=dp, tp=tp, pp=pp)
        out.append({"coords": (m.dp_rank, m.tp_rank, m.pp_rank), "str": str(m),
                    "groups": _groups(m, ("dp", "tp", "pp")), "cp": (m.cp, m.cp_rank),
                    "dp_cp_is_dp": m.dp_cp_group is m.dp_group,
                    "cp_group": dist.get_process_group_ranks(m.cp_group)})
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
            # cp == 1: a cp group of one rank, and the gradient group is dp's own
            assert g["cp"] == (1, 0) and g["cp_group"] == [r] and g["dp_cp_is_dp"]


def _cp_layouts(rank, world):
    out = []
    for dp, cp, tp, pp in CP_LAYOUTS:
        m = Mesh(dp, tp, pp, cp=cp)
        out.append({"coords": (m.dp_rank, m.cp_rank, m.tp_rank, m.pp_rank), "str": str(m),
                    "dict": m.coords, "groups": _groups(m, ("dp", "cp", "tp", "pp", "dp_cp"))})
    return out


@pytest.mark.dist
def test_context_parallel_rank_order_and_groups_at_4_ranks():
    got = run_ranks(_cp_layouts, 4)
    for i, (dp, cp, tp, pp) in enumerate(CP_LAYOUTS):
        # tp innermost, then cp, then dp, then pp (Megatron-Core's order)
        every = {q: ((q // (cp * tp)) % dp, (q // tp) % cp, q % tp, q // (dp * cp * tp))
                 for q in range(4)}
        for r in range(4):
            g, want = got[r][i], every[r]
            assert g["coords"] == want, (dp, cp, tp, pp, r)
            assert g["dict"] == dict(zip(("dp", "cp", "tp", "pp"), want))
            for k, axes in (("dp", {0}), ("cp", {1}), ("tp", {2}), ("pp", {3}),
                            ("dp_cp", {0, 1})):  # the ranks that vary only along `axes`
                same = sorted(q for q, c in every.items()
                              if all(c[a] == want[a] for a in range(4) if a not in axes))
                assert g["groups"][k] == same, (k, dp, cp, tp, pp, r)
            assert f"dp={dp}, cp={cp}, tp={tp}, pp={pp}" in g["str"], g["str"]
            assert f"cp {want[1]}, tp" in g["str"]


def _bad(rank, world, dp, tp, pp, cp):
    Mesh(dp=dp, tp=tp, pp=pp, cp=cp)


@pytest.mark.dist
@pytest.mark.parametrize("dp,tp,pp,cp", [(2, 2, 2, 1), (3, 1, 1, 1), (1, 1, 1, 1), (1, 2, 1, 2)])
def test_wrong_product_names_the_numbers(dp, tp, pp, cp):
    errors = run_ranks(_bad, 2, dp, tp, pp, cp, expect_errors=True)
    for e in errors:
        assert isinstance(e, RankError) and e.kind == "ValueError"
        what = f"dp={dp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp} x pp={pp}"
        assert f"{what} = {dp * cp * tp * pp}" in e.message
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
    c = Mesh(dp=1, tp=1, pp=1, group=mine, cp=2)  # dp_cp made by local synchronization
    return (m.rank, m.world, m.tp_rank, dist.get_process_group_ranks(m.tp_group),
            c.cp_rank, dist.get_process_group_ranks(c.cp_group),
            dist.get_process_group_ranks(c.dp_cp_group))


@pytest.mark.dist
def test_mesh_over_a_subgroup():
    got = run_ranks(_sub, 4)
    assert got == [(0, 2, 0, [0, 1], 0, [0, 1], [0, 1]), (1, 2, 1, [0, 1], 1, [0, 1], [0, 1]),
                   (0, 2, 0, [2, 3], 0, [2, 3], [2, 3]), (1, 2, 1, [2, 3], 1, [2, 3], [2, 3])]


REPLICA_LAYOUTS = [(2, 2, 1, 1, 1), (2, 1, 2, 1, 1), (2, 1, 1, 2, 1), (2, 1, 1, 1, 2),
                   (4, 1, 1, 1, 1)]  # replicas, dp, tp, pp, cp


def _replica_layouts(rank, world):
    out = []
    for R, dp, tp, pp, cp in REPLICA_LAYOUTS:
        m = Mesh(dp, tp, pp, cp=cp, replicas=R)
        out.append({"coords": (m.replica_rank, m.pp_rank, m.dp_rank, m.cp_rank, m.tp_rank),
                    "str": str(m), "inner": m.inner, "inner_dims": m.inner_mesh.mesh_dim_names,
                    "groups": _groups(m, ("replica", "dp", "cp", "tp", "pp", "dp_cp"))})
    one = Mesh(dp=world)  # without replicas: a replica group of this rank alone
    out.append(dist.get_process_group_ranks(one.replica_group))
    return out


@pytest.mark.dist
def test_replicas_are_outermost_and_each_replica_is_the_usual_mesh_on_contiguous_ranks():
    got = run_ranks(_replica_layouts, 4)
    for i, (R, dp, tp, pp, cp) in enumerate(REPLICA_LAYOUTS):
        inner = dp * cp * tp * pp
        # by hand: replica = r // inner, then Megatron's order inside (pp, dp, cp, tp)
        every = {q: (q // inner, (q % inner) // (dp * cp * tp), (q % inner) // (cp * tp) % dp,
                     (q % inner) // tp % cp, q % tp) for q in range(4)}
        for r in range(4):
            g, want = got[r][i], every[r]
            assert g["coords"] == want and g["inner"] == inner, (R, dp, tp, pp, cp, r)
            assert g["inner_dims"] == ("pp", "dp", "cp", "tp")
            for k, axes in (("replica", {0}), ("pp", {1}), ("dp", {2}), ("cp", {3}),
                            ("tp", {4}), ("dp_cp", {2, 3})):
                same = sorted(q for q, c in every.items()
                              if all(c[a] == want[a] for a in range(5) if a not in axes))
                assert g["groups"][k] == same, (k, R, dp, tp, pp, cp, r)
            assert f"replicas={R}, dp={dp}" in g["str"] and f"replica {want[0]}, dp" in g["str"]
    assert [got[r][-1] for r in range(4)] == [[0], [1], [2], [3]]


def _bad_replicas(rank, world):
    Mesh(dp=2, replicas=2)


@pytest.mark.dist
def test_replicas_that_do_not_tile_the_world_are_named():
    for e in run_ranks(_bad_replicas, 2, expect_errors=True):
        assert e.kind == "ValueError"
        assert "replicas=2 x dp=2 x tp=1 x pp=1 = 4 ranks, but the world size is 2" in e.message


def _replica_group_is_its_own(rank, world):
    m = Mesh(dp=1, replicas=world)  # the replica dimension spans the world
    return m.replica_group is not dist.group.WORLD and \
        dist.get_process_group_ranks(m.replica_group) == list(range(world))


@pytest.mark.dist
def test_replica_group_is_never_the_default_group():
    """DiLoCo all-reduces over it on a worker thread while the main thread uses the default
    group: one group for both mismatched gloo's operations (see Mesh.__init__)."""
    assert run_ranks(_replica_group_is_its_own, 2) == [True, True]
