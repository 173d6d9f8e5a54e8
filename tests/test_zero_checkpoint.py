"""pyfast.parallel.zero.checkpoint: sharded DCP checkpoints of zero() models at stages 1-3.

Saved at world 2 after 3 AdamW steps, then
- loaded at world 2 into a fresh model and optimizer: 2 more steps are bit-identical to the run
  that never stopped; get_state_dict + dcp.load + set_state_dict (in place) restore the saved
  state bit for bit;
- loaded at world 4 into the same stage (a parameter of 5 elements leaves rank 3 an empty
  shard), and at world 1 (rank 0 alone in a group of its own) into another stage (1, 2 -> 3:
  whole tensors read as shards; 3 -> 2: shards into replicated parameters): full_state_dict is
  the saved full state, bit for bit (resharding only moves bytes), as is a full_state_dict
  of world 2 given to set_state_dict at world 4;
- bf16 parameters at stage 2 resume bit-identically (their fp32 master shards are saved);
- full_state_dict at the save equals one process running torch AdamW on the whole batch, within
  fp32 rounding of the different gradient summation (each rank averages half the batch).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import RankPool, run_ranks

STAGES = (1, 2, 3)
SAME_STAGE, OTHER_STAGE = {1: 1, 2: 2, 3: 3}, {1: 3, 2: 3, 3: 2}  # saved stage -> loading stage
GLOBAL_BATCH, STEPS, MORE = 8, 3, 2
OPT = dict(lr=1e-2, weight_decay=0.1)


class Net(nn.Module):
    """Uneven shards at W=2 and 4 (91, 65 and 5 elements), a buffer, a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 13), nn.Linear(13, 5)
        self.register_buffer("shift", torch.linspace(-1, 1, 7))
        self.scale = nn.Parameter(torch.full((5,), 0.5), requires_grad=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x + self.shift))) * self.scale


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def _build(stage: int, seed: int, group=None, dtype=torch.float32):
    from pyfast.parallel.zero import zero
    torch.manual_seed(seed)
    return zero(Net().to(dtype), torch.optim.AdamW, stage=stage, group=group, **OPT)


def _train(model, opt, first: int, n: int, rank: int, world: int) -> None:
    per = GLOBAL_BATCH // world
    dtype = next(model.parameters()).dtype
    for step in range(first, first + n):
        x, y = (t.to(dtype) for t in _batch(step))
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _save_and_resume(rank, world, root):
    import torch.distributed.checkpoint as dcp

    from pyfast.parallel.zero import checkpoint as ck
    out = {}
    for stage in STAGES:
        path = f"{root}/stage{stage}"
        model, opt = _build(stage, seed=0)
        _train(model, opt, 0, STEPS, rank, world)
        ck.save(path, model, opt)
        saved = ck.full_state_dict(model, opt)
        _train(model, opt, STEPS, MORE, rank, world)
        straight = ck.full_state_dict(model, opt)
        model2, opt2 = _build(stage, seed=1)  # other weights, no optimizer state
        ck.load(path, model2, opt2)
        _train(model2, opt2, STEPS, MORE, rank, world)
        resumed = ck.full_state_dict(model2, opt2)
        sd = ck.get_state_dict(model2, opt2)  # live tensors: dcp.load fills them in place
        dcp.load(sd, checkpoint_id=path)
        ck.set_state_dict(model2, opt2, sd)
        out[stage] = {"saved": saved, "straight": straight, "resumed": resumed,
                      "in_place": ck.full_state_dict(model2, opt2)}
        if stage < 3:  # torch's own per-rank state dicts (same world): opt.state_dict() holds
            # this rank's shards; stage 3's model.state_dict() holds 0-element parameters
            model3, opt3 = _build(stage, seed=1)
            ck.load(path, model3, opt3)  # back to the saved step, then the plain torch route
            model4, opt4 = _build(stage, seed=2)
            model4.load_state_dict(model3.state_dict())
            opt4.load_state_dict(opt3.state_dict())
            assert len(opt4.state) == len(opt3.state) > 0, "load_state_dict loaded no state"
            _train(model4, opt4, STEPS, MORE, rank, world)
            out[stage]["torch_sd"] = ck.full_state_dict(model4, opt4)
    # bf16 parameters: stage 2's fp32 master shards are tensors of their own, saved beside
    # the optimizer state; a resume from the rounded parameters alone would not be identical
    path = f"{root}/bf16"
    model, opt = _build(2, 0, dtype=torch.bfloat16)
    _train(model, opt, 0, STEPS, rank, world)
    ck.save(path, model, opt)
    _train(model, opt, STEPS, MORE, rank, world)
    model2, opt2 = _build(2, 1, dtype=torch.bfloat16)
    ck.load(path, model2, opt2)
    _train(model2, opt2, STEPS, MORE, rank, world)
    out["bf16"] = {"straight": ck.full_state_dict(model, opt),
                   "resumed": ck.full_state_dict(model2, opt2)}
    return out


def _reload(rank, world, root, full):
    """World 4 (every rank, the same stage as saved), then world 1 (rank 0 alone in a group of
    its own, another stage): rank 0's full state dicts, {} elsewhere (rank0_only). Also at
    world 4: set_state_dict from the full (exported) state dicts of world 2, `full`."""
    import torch.distributed as dist

    from pyfast.parallel.zero import checkpoint as ck
    one = dist.new_group([0])  # collective: every rank creates it
    out = {}
    for world_, group, stage_of in ((world, None, SAME_STAGE), (1, one, OTHER_STAGE)):
        for saved_stage in STAGES:
            got = {}
            if group is None or rank == 0:
                model, opt = _build(stage_of[saved_stage], 2, group)
                ck.load(f"{root}/stage{saved_stage}", model, opt)
                got = ck.full_state_dict(model, opt, rank0_only=True)
            out[(world_, saved_stage)] = got
    for stage in STAGES:
        model, opt = _build(stage, 3)
        ck.set_state_dict(model, opt, full[stage])
        out[("full", stage)] = ck.full_state_dict(model, opt, rank0_only=True)
    return out


def _reference():
    """One process, torch AdamW, the whole batch: the full state after STEPS steps."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], **OPT)
    for step in range(STEPS):
        x, y = _batch(step)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    names = {id(p): n for n, p in net.named_parameters()}
    return net.state_dict(), {names[id(p)]: s for p, s in opt.state.items()}


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a["model"].keys() == b["model"].keys(), what
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{what}: model {k}"
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys(), what
    for fqn, st in a["optim"]["state"].items():
        assert st.keys() == b["optim"]["state"][fqn].keys(), f"{what}: {fqn}"
        for k, v in st.items():
            assert torch.equal(v, b["optim"]["state"][fqn][k]), f"{what}: optim {fqn}.{k}"
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"], what


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero_ckpt"))
    with RankPool(2) as pool:
        out = pool.run(_save_and_resume, root, timeout=180)
    return root, out


@pytest.mark.parametrize("stage", STAGES)
def test_resume_at_same_world_is_bit_identical(saved, stage):
    _, out = saved
    for rank in (0, 1):
        r = out[rank][stage]
        _assert_same(r["resumed"], r["straight"], f"rank {rank} stage {stage} resumed")
        _assert_same(r["in_place"], r["saved"], f"rank {rank} stage {stage} in place")
        if stage < 3:
            _assert_same(r["torch_sd"], r["straight"], f"rank {rank} stage {stage} torch sd")
        assert not torch.equal(r["saved"]["model"]["fc1.weight"],
                               r["straight"]["model"]["fc1.weight"])  # the steps did something
    _assert_same(out[0][stage]["saved"], out[1][stage]["saved"], "ranks agree")


def test_bf16_parameters_resume_from_their_fp32_masters(saved):
    _, out = saved
    r = out[0]["bf16"]
    _assert_same(r["resumed"], r["straight"], "bf16 stage 2 resumed")
    assert r["straight"]["model"]["fc1.weight"].dtype == torch.bfloat16
    master = r["straight"]["optim"]["state"]["fc1.weight"]["fp32_master"]
    assert master.dtype == torch.float32
    assert torch.equal(master.bfloat16(), r["straight"]["model"]["fc1.weight"])
    assert not torch.equal(master, master.bfloat16().float())  # more than the rounded value


def test_reshard_to_4_ranks_and_to_1(saved):
    root, out = saved
    got = run_ranks(_reload, 4, root, {s: out[0][s]["saved"] for s in STAGES}, timeout=180)
    for stage in STAGES:
        _assert_same(got[0][("full", stage)], out[0][stage]["saved"],
                     f"stage {stage}: world 2's full state dict set at world 4")
    for world, stage_of in ((4, SAME_STAGE), (1, OTHER_STAGE)):
        for stage in STAGES:
            _assert_same(got[0][(world, stage)], out[0][stage]["saved"],
                         f"stage {stage} saved at 2 ranks, loaded at {world} as stage "
                         f"{stage_of[stage]}")
            assert all(g[(world, stage)] == {} for g in got[1:])  # rank0_only, or not in it


@pytest.mark.parametrize("stage", STAGES)
def test_full_state_equals_one_process(saved, stage):
    _, out = saved
    model_sd, optim_state = _reference()
    full = out[0][stage]["saved"]
    assert full["model"].keys() == model_sd.keys()
    for k, v in model_sd.items():
        assert full["model"][k].shape == v.shape
        # fp32 rounding of a different summation order through 3 AdamW steps of lr 1e-2:
        # measured 3e-8 (every stage)
        torch.testing.assert_close(full["model"][k], v, rtol=0, atol=1e-6, msg=k)
    assert full["optim"]["state"].keys() == optim_state.keys()
    for fqn, st in optim_state.items():
        for k, v in st.items():
            got = full["optim"]["state"][fqn][k]
            assert got.shape == v.shape, (fqn, k)
            # measured: relative 6e-5 for exp_avg's smallest elements, 3e-7 for exp_avg_sq
            torch.testing.assert_close(got, v, rtol=1e-4, atol=1e-7, msg=f"{fqn}.{k}")
    groups = full["optim"]["param_groups"]
    assert [g["params"] for g in groups] == [["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]]
    assert groups[0]["lr"] == OPT["lr"] and groups[0]["weight_decay"] == OPT["weight_decay"]
