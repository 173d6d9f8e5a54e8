"""`pyfast train --cp N` end to end on gpt-tiny, fp32: context-parallel runs against the
1-process run of the same flags (the helpers and flags of tests/test_train.py).

Tolerances. Losses and gradient norms: 1e-5 relative per step (measured <= 1e-7): a cp rank's
loss is its shard's mean and the ring merges attention blocks by log-sum-exp, which only
reorders fp32 sums. Final parameters after 3 AdamW steps (lr 1e-3): |cp - one| <= 1e-5 +
1e-5 |one| per element (measured <= 7e-7). AdamW's early updates are about lr x sign(g), so an
element whose gradient is well above Adam's eps (1e-8) moves the same in both runs, and one
whose gradient is rounding noise (the key bias: softmax ignores it; ~1e-9) moves by at most
lr x noise / eps, ~1e-4 lr; the bound is 1% of one step's lr. A wrong position or a missing
key block changes the gradients by their own size, hence the updates by ~lr = 1e-3.
"""
import os
import shutil
import tempfile

import pytest
import torch

from test_train import BASE, losses, pool_train, records, rel, shared_runs

CP = {  # name: (nproc, flags, reference); 7 jobs with the resume, ~50 s on 2 quiet cores
    "1proc": (1, [], None),
    "1proc-learned": (1, ["--positions", "learned"], None),
    "cp2": (2, ["--cp", "2"], "1proc"),  # ring, zigzag: the defaults
    # each method and layout apart, and learned positions: tests/test_models.py (no job each)
    "cp2-ulysses-contiguous": (2, ["--cp", "2", "--cp-method", "ulysses",
                                   "--cp-layout", "contiguous"], "1proc"),
    # 4 ranks: cp with dp under ZeRO-2 (its shards and gradient reduce-scatter over dp x cp),
    # and cp with tp (ring attention over each tp rank's 2 heads) and learned positions
    "dp2xcp2-zero2": (4, ["--dp", "2", "--cp", "2", "--zero", "2"], "1proc"),
    "cp2xtp2-learned": (4, ["--cp", "2", "--tp", "2", "--positions", "learned"],
                        "1proc-learned"),
}
STEPS = 3  # BASE: 3 steps of 8 x 32 tokens, checkpoints at 2 and 3, validation at 2 and 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # the 4-rank jobs first: the longest ones, so that the 1- and 2-rank ones fill the other
    # slot; "1proc" is test_train.py's own run when that file ran first (shared_runs)
    order = sorted(CP, key=lambda n: -CP[n][0])
    return shared_runs(tmp_path_factory, {n: CP[n][:2] for n in order})


def model_of(run, step: int = STEPS) -> dict:
    """The whole model's tensors by name from a (non-ZeRO) DCP checkpoint, on one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(run / "checkpoints" / f"step-{step}", os.path.join(d, "m.pt"))
        return torch.load(os.path.join(d, "m.pt"), weights_only=False)["model"]


@pytest.mark.dist
@pytest.mark.parametrize("name", [n for n in CP if CP[n][2]])
def test_cp_equals_one_process(runs, name):
    got, ref = records(runs[name]), records(runs[CP[name][2]])
    assert len(got) == len(ref) == STEPS
    for key in ("loss", "grad_norm"):
        assert rel([r[key] for r in got], [r[key] for r in ref]) < 1e-5, (key, got, ref)
    # the validation loss (the same model's, on the whole held-out sequences) after steps 2, 3
    assert rel([r["val_loss"] for r in got[1:]], [r["val_loss"] for r in ref[1:]]) < 1e-5
    if "zero" not in name:  # ZeRO checkpoints hold flat shards (tests/test_zero_checkpoint.py)
        want, have = model_of(runs[CP[name][2]]), model_of(runs[name])
        assert want.keys() == have.keys()
        for k in want:
            torch.testing.assert_close(have[k], want[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.dist
def test_cp2_checkpoint_resumes_on_one_process(runs, tmp_path):
    """Parameters are replicated over cp: a cp=2 checkpoint is the whole model."""
    src = tmp_path / "cp2"
    shutil.copytree(runs["cp2"], src)
    shutil.rmtree(src / "checkpoints" / f"step-{STEPS}")
    p = pool_train(src, 1, ["--resume"])  # one process: the job on a forked rank
    assert "another mesh" in p.stdout
    got, ref = losses(src), losses(runs["1proc"])
    assert abs(got[-1] - ref[-1]) / ref[-1] < 1e-5, (got, ref)

