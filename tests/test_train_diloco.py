"""`pyfast train --diloco H --replicas R`: checks before launch (in-process, milliseconds), and
real runs of gpt-tiny (torchrun via --nproc) against DiLoCo driven by hand, resumes and
restarts."""
import pytest

from pyfast.train import main
from pyfast.train.config import from_args, parser
from pyfast.train.launch import worker_args

TINY = ["--model", "gpt-tiny", "--steps", "2", "--batch", "8", "--seq", "32"]
DL = ["--diloco", "4", "--replicas", "2"]


@pytest.mark.parametrize("flags,message", [
    (["--diloco", "-1"], "--diloco H: the inner steps per outer step must be >= 1 (0: off), "
                         "got -1"),
    (["--replicas", "2"], "--replicas 2 without --diloco H: replicas meet only in DiLoCo's"),
    (["--fragments", "2", "--outer-lr", "0.5"], "--fragments 2, --outer-lr 0.5 without --diloco"),
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (DL + ["--nproc", "3"], "--replicas 2 x --dp 1 x --tp 1 x --pp 1 = 2 ranks, but --nproc 3"),
    (DL + ["--dp", "2", "--nproc", "2"], "--replicas 2 x --dp 2 x --tp 1 x --pp 1 = 4 ranks, "
                                         "but --nproc 2"),
    (["--diloco", "6", "--fragments", "4"], "--diloco 6 is not a multiple of --fragments 4"),
    (["--diloco", "8", "--fragments", "4", "--diloco-delay", "2"],
     "--diloco-delay 2 must be in [0, H/F = 2) (--diloco 8 / --fragments 4)"),
    (["--diloco", "4", "--diloco-alpha", "1.5"], "--diloco-alpha 1.5 must be in [0, 1]"),
    (["--diloco", "4", "--diloco-alpha", "-0.1"], "--diloco-alpha -0.1 must be in [0, 1]"),
    (["--diloco", "4", "--outer-compress", "int9"], "--outer-compress 'int9': unknown "
                                                    "compressor spec 'int9'"),
    (["--diloco", "4", "--outer-lr", "0"], "need --outer-lr > 0 and 0 <= --outer-momentum < 1"),
    (["--diloco", "4", "--outer-momentum", "1"], "got 0.7, 1.0"),
    (["--diloco", "64", "--fragments", "32"],  # gpt-tiny holds 28 parameter tensors
     "--fragments 32: more fragments than the 28 parameter tensors of gpt-tiny"),
    (DL + ["--batch", "6", "--dp", "2", "--nproc", "4"],
     "--batch 6 is not divisible by replicas 2 x dp 2 x grad-accum 1 x micro-batches 1 = 4"),
    (DL + ["--dp", "2", "--zero", "1"], "--diloco with --zero 1: the outer step needs"),
    (DL + ["--precision", "fp16"], "--diloco with --precision fp16"),
])
def test_bad_diloco_flags_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert main(TINY + ["--out", str(tmp_path)] + flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_worker_args_reproduce_the_diloco_flags():
    cfg = from_args(parser().parse_args(TINY + DL + [
        "--fragments", "2", "--diloco-delay", "1", "--outer-compress", "int4", "--outer-lr",
        "0.5", "--outer-momentum", "0.8", "--no-outer-nesterov", "--diloco-alpha", "0.25"]))
    assert not cfg.outer_nesterov and cfg.replicas == 2 and cfg.ranks == 2
    assert "--no-outer-nesterov" in worker_args(cfg)
    assert from_args(parser().parse_args(worker_args(cfg))) == cfg
