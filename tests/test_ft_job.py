"""`pyfast train --ft` (pyfast.train.ft, ft_step) against a real torchft lighthouse (its Rust
server, in this process): two replica groups of one rank each, one SIGKILLed mid-run and
restarted by its torchrun (--max-restarts 1), which resumes its checkpoint, heals from the
survivor and finishes with bit-identical parameters and optimizer state; the run's losses equal
an uninterrupted single-process run of the same global batch. Bad input through the CLI.

The killed group is a real launch (torchrun's restart is the point); the survivor, the
references and the DiLoCo groups run the job (pyfast.train.run.run) on forked ranks of their
own (test_train.pool_train, tests/ft_utils' pattern): a launch costs ~6 CPU s of torchrun and
imports before the job's first step, the file's two tests made six.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from dist_utils import RankPool
from ft_utils import group_env, store_port
from test_train import _job_logged, pool_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--model", "gpt-tiny", "--steps", "4", "--batch", "4", "--seq", "16",
          "--tensorboard", "off", "--eval-batches", "1", "--no-plot"]


def _train(args, env=None, **kw):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "pyfast", "train", *args], cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def _group(rank, world, argv, port):
    """A replica group's job on a RankPool of its own (ft_utils: torchft's stores in the
    pool's, as under torchrun's MASTER_ADDR / MASTER_PORT); its output in OUT.log.RANK.*."""
    group_env(port)
    out = argv[argv.index("--out") + 1]
    _job_logged(rank, world, argv, f"{out}.log")


def _submit(pool, argv):
    pool.submit(_group, argv, store_port(pool))


def _final(out):
    """{name: tensor} of the last checkpoint's model and optimizer state (DCP -> torch.save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    ck = sorted(os.listdir(os.path.join(out, "checkpoints")))[-1]
    dst = os.path.join(out, "final.pt")
    dcp_to_torch_save(os.path.join(out, "checkpoints", ck), dst)
    sd = torch.load(dst, weights_only=False)
    flat = {}
    for top in ("model", "optim"):
        stack = [(top, sd[top])]
        while stack:
            k, v = stack.pop()
            if isinstance(v, dict):
                stack += [(f"{k}.{a}", b) for a, b in v.items()]
            elif isinstance(v, torch.Tensor):
                flat[k] = v
    return ck, flat


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_kill_restart_heal(tmp_path):
    from torchft._torchft import LighthouseServer
    # min 2 groups: the survivor waits at its next quorum for the restarted group (else, at
    # gpt-tiny's ~0.1 s a step, it would finish before the restart's ~5 s and leave it alone)
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    addr = lh.address().replace("http://", "")
    try:
        ft = ["--ft", "--lighthouse", addr, "--min-replicas", "2", "--ckpt-every", "1"]
        t0 = time.monotonic()
        with RankPool(1, pg_timeout=600) as survivor:
            _submit(survivor, COMMON + ft + ["--replica-id", "0", "--out", str(tmp_path / "g0")])
            g1 = _train(COMMON + ft + ["--replica-id", "1", "--out", str(tmp_path / "g1"),
                                       "--max-restarts", "1"], env={"PYFAST_FAULT": "step@2"})
            try:
                pool_train(tmp_path / "ref", 1, ["--grad-accum", "2", "--ckpt-every", "1"],
                           base=COMMON)
                out1 = g1.communicate(timeout=600)[0]
                survivor.wait(600)
            finally:  # a hang must not outlive the test (nor its lighthouse)
                if g1.poll() is None:
                    os.killpg(g1.pid, 9)
        took = time.monotonic() - t0
    finally:
        lh.shutdown()
    assert g1.returncode == 0, out1[-3000:]
    assert "PYFAST_FAULT step@2: SIGKILL" in out1, out1[-2000:]
    ck0, a = _final(tmp_path / "g0")
    ck1, b = _final(tmp_path / "g1")
    assert ck0 == ck1 == "step-4"
    assert a.keys() == b.keys() and len(a) > 10
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"healed group differs from the survivor in {bad[:5]}"
    # the survivor's step counter went through the failure: steps 1..4, all committed by 2 groups
    r0 = _losses(tmp_path / "g0")
    assert [r["step"] for r in r0] == [1, 2, 3, 4]
    assert all(r["committed"] and r["participants"] == 2 for r in r0)
    # the same global batch as one process with 2 micro-batches: the same losses and weights;
    # the reduction order differs (a sum over 2 groups vs accumulation), hence 1e-5 / 1e-4
    ref_rec = _losses(tmp_path / "ref")
    for r, q in zip(r0, ref_rec):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-5), (r, q)
    _, c = _final(tmp_path / "ref")
    for k in (k for k in c if k.startswith("model.")):
        torch.testing.assert_close(a[k], c[k], rtol=1e-4, atol=1e-5)
    print(f"kill/restart/heal run: {took:.1f} s")


@pytest.mark.parametrize("args, want", [
    (["--ft", "--replica-id", "0"], "--ft needs --lighthouse"),
    (["--lighthouse", "localhost:1"], "without --ft"),
    (["--ft", "--lighthouse", "nohostport", "--replica-id", "0"], "expected HOST:PORT"),
    (["--ft", "--lighthouse", "localhost:9", "--replica-id", "0", "--pp", "2"], "--ft with --pp 2"),
    (["--ft", "--lighthouse", "localhost:9", "--replica-id", "0", "--min-replicas", "3"],
     "not divisible by min-replicas 3"),
    (["--ft", "--lighthouse", "localhost:9", "--replica-id", "0", "--dry-run"],
     "--dry-run with --ft"),
    (["--ft", "--lighthouse", "localhost:9", "--replica-id", "0", "--elastic"],
     "--ft with --elastic"),
])
def test_bad_flags(args, want, capsys, tmp_path):
    from pyfast.train import main
    assert main(COMMON + ["--out", str(tmp_path)] + args) == 2
    assert want in capsys.readouterr().err


def test_lighthouse_unreachable(tmp_path, capsys):
    """Nothing listens at the port: refused by the launcher in well under a second, before
    torchrun starts any rank (torchft itself retries for connect_timeout, then fails deep in a
    quorum)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port that was free a moment ago: nothing listens there
    from pyfast.train import main
    t0 = time.monotonic()
    code = main(COMMON + ["--ft", "--lighthouse", f"127.0.0.1:{port}", "--replica-id", "0",
                          "--out", str(tmp_path)])
    assert code == 2 and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert f"--lighthouse 127.0.0.1:{port}: no torchft lighthouse answers" in err


def test_diloco_job_under_ft_equals_replicas(tmp_path):
    """`pyfast train --ft --diloco 2` with two groups == `--nproc 2 --replicas 2 --diloco 2`
    (group N reads replica N's slice): the same replica-0 losses (one group's own inner
    steps, bit for bit) and, after the last outer step, the same weights on both groups
    (bitwise) and the reference's within 1e-5 (int8 outer gradients summed then divided
    here, averaged in the reference: a rounding apart)."""
    from torchft._torchft import LighthouseServer
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    addr = lh.address().replace("http://", "")
    di = ["--diloco", "2", "--outer-compress", "int8", "--steps", "4"]
    try:
        ft = ["--ft", "--lighthouse", addr, "--min-replicas", "2"] + di
        with RankPool(1, pg_timeout=600) as a, RankPool(1, pg_timeout=600) as b:
            for g, pool in enumerate((a, b)):
                _submit(pool, COMMON + ft + ["--replica-id", str(g),
                                             "--out", str(tmp_path / f"g{g}")])
            pool_train(tmp_path / "ref", 2, di + ["--replicas", "2"], base=COMMON)
            a.wait(600)
            b.wait(600)
    finally:
        lh.shutdown()
    r0, ref = _losses(tmp_path / "g0"), _losses(tmp_path / "ref")
    assert [r["loss"] for r in r0] == [r["loss"] for r in ref]
    assert [(r["step"], r.get("participants"), r.get("outer_committed")) for r in r0] == \
        [(1, None, None), (2, 2, True), (3, None, None), (4, 2, True)]
    _, a = _final(tmp_path / "g0")
    _, b = _final(tmp_path / "g1")
    _, c = _final(tmp_path / "ref")
    for k in (k for k in a if k.startswith("model.")):
        assert torch.equal(a[k], b[k]), k
        torch.testing.assert_close(a[k], c[k], rtol=1e-5, atol=1e-5)


def test_ft_flag_defaults_are_the_configs():
    from pyfast.train import ft
    from pyfast.train.config import TrainConfig
    d = TrainConfig()
    assert {k: getattr(d, k) for k in ft.DEFAULTS} == ft.DEFAULTS and d.ft is False
