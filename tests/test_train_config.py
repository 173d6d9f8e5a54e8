"""`pyfast train`'s checks before any rank starts, its launch command, checkpoint discovery and
the metrics log, in-process (no ranks: each case takes milliseconds)."""
import json

import pytest

from pyfast.train import TrainConfig, main
from pyfast.train import checkpoint as ck
from pyfast.train.config import from_args, parser
from pyfast.train.launch import worker_args
from pyfast.train.metrics import MetricsLog, read

TINY = ["--model", "gpt-tiny", "--steps", "2", "--batch", "8", "--seq", "32"]


def fake_checkpoint(out, step, **key):
    d = out / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    model_key = {**TrainConfig(model="gpt-tiny", seq=32).model_key(), **key}
    (d / "meta.json").write_text(json.dumps({"step": step, "model_key": model_key}))
    return d


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "2", "--dp", "1"], "--dp 1 x --tp 1 x --pp 1 = 1 ranks, but --nproc 2"),
    (["--dp", "2", "--tp", "2", "--nproc", "2"], "= 4 ranks, but --nproc 2"),
    (["--tp", "3"], "--tp 3: GPTConfig: n_head 4 is not divisible by tp=3"),
    (["--tp", "8"], "n_head 4 is not divisible by tp=8"),
    (["--pp", "3", "--micro-batches", "1"],
     "--pp 3: more pipeline stages than the 2 transformer layers of gpt-tiny"),
    (["--dp", "2", "--batch", "6", "--grad-accum", "2"],
     "--batch 6 is not divisible by dp 2 x grad-accum 2 x micro-batches 1 = 4"),
    (["--pp", "2", "--micro-batches", "3"],
     "not divisible by dp 1 x grad-accum 1 x micro-batches 3"),
    (["--dp", "2", "--bucket-mb", "-1"], "--bucket-mb must be > 0 (0: DataParallel's default)"),
    (["--model", "gpt-huge"], "--model 'gpt-huge' is unknown; known: gpt-tiny, gpt-small"),
    (["--dp", "2", "--compress", "int9"], "--compress 'int9': unknown compressor spec 'int9'"),
    (["--compress", "int8"], "--compress int8 compresses the data-parallel gradient reduction, "
                             "but --dp is 1"),
    (["--pp", "2", "--tie-embeddings"], "--tie-embeddings with --pp > 1"),
    (["--zero", "2"], "--zero 2 shards over the data-parallel ranks, but --dp is 1"),
    (["--dp", "2", "--zero", "2", "--param-compress", "int8"],
     "--param-compress int8 compresses stage 3's parameter all-gather: it needs --zero 3 "
     "(got --zero 2)"),
    (["--param-compress", "bf16"], "--param-compress bf16 compresses stage 3's parameter "
                                   "all-gather: it needs --zero 3 (got --zero 0)"),
    (["--dp", "2", "--zero", "3", "--param-compress", "int3"], "--param-compress 'int3': one of"),
    (["--dp", "2", "--zero", "2", "--compress", "powersgd:4"],
     "--compress powersgd:4 with --zero 2: the gradient reduce-scatter takes one fixed"),
    (["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "zb-h1", "--nproc", "4"],
     "--zero 3 with --schedule zb-h1: zero bubble splits backward into input- and "
     "weight-gradient passes"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
    (["--cp", "2", "--nproc", "3"], "--dp 1 x --cp 2 x --tp 1 x --pp 1 = 2 ranks, but --nproc 3"),
    (["--cp", "2", "--seq", "30"], "--seq 30 is not divisible by 4 (2 x --cp 2, --cp-layout "
                                   "zigzag): every cp rank holds equal chunks"),
    (["--cp", "4", "--seq", "30", "--cp-layout", "contiguous"],
     "--seq 30 is not divisible by 4 (--cp 4, --cp-layout contiguous)"),
    (["--cp", "8", "--cp-method", "ulysses"], "--cp-method ulysses with --cp 8: each tp rank "
                                              "holds 4 heads (n_head 4 / --tp 1), not divisible"),
    (["--cp", "2", "--tp", "4", "--cp-method", "ulysses"],
     "holds 1 heads (n_head 4 / --tp 4), not divisible by 2; use --cp-method ring"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--dp", "4", "--zero-shard-group", "2"], "--zero-shard-group 2 chooses the ranks ZeRO "
                                               "shards over: it needs --zero 1, 2 or 3"),
    (["--dp", "4", "--zero", "2", "--zero-shard-group", "3"],
     "--zero-shard-group 3: must be >= 1 and divide dp x cp = 4 x 1 = 4"),
    (["--dp", "4", "--zero", "2", "--zero-shard-group", "0"], "--zero-shard-group 0: must be >= 1"),
    (["--dp", "4", "--zero", "2", "--zero-shard-group", "nodes"],
     "--zero-shard-group must be 'node' or a number of ranks, got 'nodes'"),
    (["--dp", "6", "--batch", "12", "--zero", "2", "--zero-shard-group", "2", "--nnodes", "2",
      "--rdzv-endpoint", "localhost:1"], "a shard group spans 2 consecutive ranks, which cross "
                                         "a node's boundary (3 ranks a node)"),
    (["--dp", "4", "--zero", "2", "--zero-shard-group", "2", "--compress", "int8",
      "--precision", "fp16"], "--zero-shard-group with --precision fp16 and --compress int8: "
                              "the cross-node compressor's error-feedback memory"),
    (["--lr-decay-steps", "-1"], "--lr-decay-steps must be >= 0 (0: --steps), got -1"),
    (["--dp", "2", "--offload", "optimizer"], "--offload optimizer moves ZeRO's shards to host "
                                              "memory: it needs --zero 1, 2 or 3"),
    (["--dp", "2", "--zero", "2", "--offload", "params"], "--offload params keeps stage 3's "
                                                          "parameter shards on the host; --zero 2"),
    (["--dp", "2", "--zero", "2", "--offload-delay"], "--offload-delay / --offload-prefetch "
                                                      "tune --offload"),
    (["--dp", "2", "--zero", "3", "--offload", "params", "--offload-prefetch", "0"],
     "--offload-prefetch must be >= 1, got 0"),
    (["--dp", "2", "--zero", "2", "--offload", "optimizer", "--offload-prefetch", "2"],
     "--offload-prefetch 2: how many units stage 3 gathers ahead; --zero 2 has no"),
])
def test_bad_flags_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert main(TINY + ["--out", str(tmp_path)] + flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_shard_group_node_is_the_dp_cp_ranks_of_a_node():
    from pyfast.train.config import ConfigError, check_shard_group
    cfg = TrainConfig(dp=4, tp=2, zero=2, zero_shard_group="node")
    assert check_shard_group(cfg, 4) == 2      # 4 ranks a node / tp 2: 2 dp ranks
    assert check_shard_group(cfg, 16) is None  # the node holds the whole dp group: no hybrid
    assert check_shard_group(cfg, None) is None  # the launcher: LOCAL_WORLD_SIZE not known yet
    with pytest.raises(ConfigError, match="a node holds 3 ranks, not whole tp groups of --tp 2"):
        check_shard_group(cfg, 3)
    with pytest.raises(ConfigError, match=r"the 3 dp x cp ranks of a node \(3 ranks / --tp 1\) "
                                          "do not divide dp x cp = 4"):
        check_shard_group(TrainConfig(dp=4, zero=2, zero_shard_group="node"), 3)
    assert check_shard_group(TrainConfig(dp=4, zero=2, zero_shard_group="4"), 2) is None


def test_resume_without_a_checkpoint_and_of_another_model(tmp_path, capsys):
    assert main(TINY + ["--out", str(tmp_path), "--resume"]) == 2
    assert "--resume: no complete checkpoint under" in capsys.readouterr().err
    fake_checkpoint(tmp_path, 4, model="gpt-small")
    assert main(TINY + ["--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step-4 holds a different model" in err and "'gpt-small'" in err
    # and a fresh run would mix its checkpoints with those: refused
    assert main(TINY + ["--out", str(tmp_path)]) == 2
    assert "already has checkpoints (latest step 4): pass --resume" in capsys.readouterr().err


def test_checkpoint_scan_takes_only_complete_ones(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 10)
    (tmp_path / "checkpoints" / ".tmp-step-12").mkdir()  # a crash mid-write
    partial = tmp_path / "checkpoints" / "step-11"  # shards without the commit's meta.json
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"x")
    assert [s for s, _ in ck.complete(tmp_path)] == [2, 10]
    assert ck.latest(tmp_path)[0] == 10  # numeric order, not "10" < "2"


def test_print_launch_gives_torchrun_per_node(capsys):
    assert main(TINY + ["--dp", "4", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint",
                        "host0:29400", "--print-launch", "--max-restarts", "3"]) == 0
    out = capsys.readouterr().out
    for node in (0, 1):
        assert (f"torchrun --nproc-per-node 2 --max-restarts 3 --nnodes 2 --node-rank {node} "
                f"--rdzv-endpoint host0:29400 -m pyfast train") in out
    assert "--dp 4" in out and "--model gpt-tiny" in out and "--nproc " not in out.replace(
        "--nproc-per-node", "")


def test_worker_args_reproduce_the_config():
    cfg = from_args(parser().parse_args(TINY + ["--dp", "2", "--precision", "bf16",
                                                "--activation-checkpointing", "--lr", "3e-4",
                                                "--data", "x.txt"]))
    assert from_args(parser().parse_args(worker_args(cfg))) == cfg
    cfg = from_args(parser().parse_args(TINY + ["--dp", "2", "--zero", "3", "--offload",
                                                "params", "--offload-prefetch", "2",
                                                "--offload-delay"]))
    assert (cfg.offload, cfg.offload_prefetch, cfg.offload_delay) == ("params", 2, True)
    assert from_args(parser().parse_args(worker_args(cfg))) == cfg
    # one rank: ZeRO-Offload (a shard group of one), refused without --offload (above)
    cfg = from_args(parser().parse_args(TINY + ["--zero", "2", "--offload", "optimizer"]))
    assert (cfg.dp, cfg.zero, cfg.offload) == (1, 2, "optimizer")


def test_metrics_log_resume_drops_records_after_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, None)
    for s in range(1, 6):
        log.write({"step": s, "loss": 1.0 / s})
    log.close()
    assert [r["step"] for r in read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    log = MetricsLog(tmp_path, 3)  # resumed from step 3: 4 and 5 will be recomputed
    log.write({"step": 4, "loss": 0.5})
    log.close()
    assert [r["step"] for r in read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    MetricsLog(tmp_path, None).close()  # a fresh run starts a fresh log
    assert read(tmp_path / "metrics.jsonl") == []


def test_cp_choices_are_the_context_modules():
    """The flags' choices (kept in config so parsing imports no torch) are what
    context_parallel_attention accepts."""
    from pyfast.parallel import context
    from pyfast.train import config
    assert config.CP_METHODS == context.METHODS and config.CP_LAYOUTS == context.LAYOUTS


def test_summary_counts_every_replicas_bytes():
    """With --replicas R > 1 a step's bytes_sent are replica 0's ranks only; the world's arrive
    as replicas_bytes_sent at the meetings, and the summary's row is their mean over the run."""
    from rich.console import Console

    from pyfast.train.metrics import summary

    def text(recs):
        c = Console(width=120)
        with c.capture() as cap:
            c.print(summary(recs, "t"))
        return cap.get()

    base = {"loss": 3.0, "tokens_per_s": 1.0, "step_ms": 2.0, "exposed_comm_ms": 0.0}
    plain = [{**base, "step": s, "bytes_sent": b} for s, b in ((1, 9e6), (2, 3e6), (3, 5e6))]
    assert "MB sent per step, all ranks (median)" in text(plain) and "4.00" in text(plain)
    reps = [{**base, "step": s, "bytes_sent": 1e6} for s in range(1, 5)]
    reps[1]["replicas_bytes_sent"] = 7e6   # the first meeting: steps 1-2, every rank
    reps[3]["replicas_bytes_sent"] = 9e6   # the second: steps 3-4
    out = text(reps)
    assert "mean over the run" in out and "4.00" in out and "1.00" not in out
