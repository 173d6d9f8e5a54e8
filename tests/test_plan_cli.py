"""`pyfast plan`: shapes, the enumeration against the job's own checks, ranking, the JSON schema,
bad input, and a run of the best plan's printed command."""
import functools
import json
import shlex
import sys
import types

import pytest

from pyfast.plan import cli, search as S, shapes
from pyfast.plan.cluster import build
from pyfast.plan.hardware import GPUS
from pyfast.plan.spec import Plan, Workload
from plan_utils import plan

TINY = ["--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "cpu",
        "--seq", "64", "--global-batch", "4", "--precision", "fp32"]
KEYS = ["dp", "cp", "tp", "pp", "zero", "shard_group", "compress", "micro_batch", "micro_batches", "schedule",
        "activation_checkpointing", "memory_bytes_per_rank", "step_s", "tokens_per_s", "command"]


def every_plan(shape, work, cluster, cross_node=False):
    for mesh in S.meshes(cluster.gpus):
        if S.mesh_problem(shape, work, cluster, *mesh, cross_node) is None:
            for group in S.mesh_plans(shape, work, *mesh):
                yield from group


# ---- shapes

def test_presets_match_their_published_sizes():
    # Llama 3.2 1B 1.24B, Llama 2 7B 6.74B, 13B 13.0B, Llama 3 70B 70.6B, 3.1 405B 405.9B
    # (their model cards; to the 3 digits they print)
    for name, billions in (("llama-1b", 1.24), ("llama-7b", 6.74), ("llama-13b", 13.0),
                           ("llama-70b", 70.6), ("llama-405b", 406)):
        assert round(shapes.preset(name).params() / 1e9, 2 if billions < 10 else 1) == \
            pytest.approx(billions, rel=2e-3), name
    s = shapes.preset("gpt-7b")
    assert (s.layers, s.hidden, s.heads, s.ffn, s.vocab) == (32, 4096, 32, 16384, 32000)
    from pyfast.models.gpt import PRESETS
    for name in ("gpt-tiny", "gpt-small"):
        s, p = shapes.preset(name), PRESETS[name]
        assert (s.layers, s.heads, s.hidden, s.vocab) == (p["n_layer"], p["n_head"],
                                                         p["d_model"], 256)


def test_shape_from_an_hf_dir_and_its_errors(tmp_path):
    cfg = {"model_type": "mistral", "num_hidden_layers": 7, "hidden_size": 320,
           "num_attention_heads": 10, "num_key_value_heads": 5, "intermediate_size": 1000,
           "vocab_size": 3001}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = shapes.resolve(f"hf:{tmp_path}", None)
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.ffn, s.vocab, s.arch, s.tied) == \
        (7, 320, 10, 5, 1000, 3001, "llama", False)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 3,
                                                  "n_embd": 96, "n_head": 6, "vocab_size": 50257}))
    s = shapes.resolve(f"hf:{gpt2}", None, layers=5)
    assert (s.layers, s.hidden, s.heads, s.ffn, s.arch, s.tied) == (5, 96, 6, 384, "gpt", True)
    with pytest.raises(ValueError, match="no such directory"):
        shapes.resolve(f"hf:{tmp_path / 'nope'}", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        shapes.resolve(f"hf:{tmp_path / 'empty'}", None)
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'intermediate_size'"):
        shapes.resolve(f"hf:{tmp_path}", None)


@pytest.mark.parametrize("n", [3.3e8, 7e9, 70e9, 405e9])
def test_shape_from_params(n):
    s = shapes.resolve(None, n)
    # the width steps by 128 (1024 from 4096 up) and the depth is re-solved: within 3% of n
    assert s.params() == pytest.approx(n, rel=0.03)
    assert s.arch == "gpt" and s.hidden % s.heads == 0 and s.ffn == 4 * s.hidden
    o = shapes.resolve(None, n, layers=9, heads=4)
    assert o.layers == 9 and o.heads == o.kv_heads == 4


# ---- the enumeration

def test_enumeration_counts_a_small_case_by_hand():
    shape, work = shapes.preset("gpt-tiny"), Workload(64, 4, "fp32")
    cl = build(2, 2, "cpu")
    # gpt-tiny: 2 layers, 4 heads, ffn 256, vocab 256 (< 2048: not split); batch 4, seq 64.
    # dp 2: 2 micro-batch sizes (1, 2) x (zero 0: 6 compressors + zero 1-3: 5 each, no
    #   powersgd) = 21 x 2 recompute = 84
    # cp 2: 3 sizes (1, 2, 4) x 21 x ring/ulysses (4 heads / 2) x 2 = 252
    # tp 2: 3 sizes x (zero 0, no compressor: no dp) x 2 = 6
    # pp 2: 3 sizes x 4 schedules (interleaved: 2 x 2 stages <= 2 layers + 2) x 2 = 24
    plans = list(every_plan(shape, work, cl))
    assert len(plans) == 84 + 252 + 6 + 24
    assert len(set(plans)) == len(plans)
    res = S.search(shape, work, cl)
    assert res.memory_scored == len(plans) and res.fitting == len(plans)


def _check_all(plans, shape, work, monkeypatch):
    """Every plan passes `pyfast train`'s own checks for its world size (the data check, the
    same for all, cached: 47 ms a call)."""
    from pyfast.train import config as C
    real = C.check_data
    once = functools.lru_cache(lambda data, batch, seq: real(
        types.SimpleNamespace(data=data, batch=batch, seq=seq)))
    monkeypatch.setattr(C, "check_data", lambda cfg: once(cfg.data, cfg.batch, cfg.seq))
    models, parser = {}, C.parser()  # one parser for every plan's flags, as argparse allows
    for p in plans:
        flags = p.train_flags(cli.gpt_model_flag(shape), work)
        cfg = C.from_args(parser.parse_args(flags))
        C.check(cfg, p.ranks, model=False)
        key = (p.tp, p.cp, p.cp_method, p.pp, p.schedule)
        if key not in models:  # the model's limits depend on these only
            models[key] = C.check_model(cfg)


@pytest.mark.parametrize("model,gpus,per_node,seq,batch", [("gpt-tiny", 2, 2, 64, 4),
                                                          ("gpt-small", 8, 4, 96, 24)])
def test_every_plan_passes_the_jobs_checks(model, gpus, per_node, seq, batch, monkeypatch):
    shape, work = shapes.preset(model), Workload(seq, batch, "bf16")
    cl = build(gpus, per_node, "h100")
    plans = list(every_plan(shape, work, cl))
    assert plans
    _check_all(plans, shape, work, monkeypatch)
    meshes = {(p.dp, p.cp, p.tp, p.pp) for p in plans}
    if gpus > per_node:  # tp x cp stays inside a node of 4: no tp 8, no tp 4 x cp 2
        assert all(tp * cp <= per_node for _, cp, tp, _ in meshes)
        assert S.mesh_problem(shape, work, cl, 1, 1, 8, 1) and \
            S.mesh_problem(shape, work, cl, 1, 1, 8, 1, cross_node=True) is None
    # 24 / dp x micro-batch: each plan's batch splits exactly
    assert all(p.dp * p.micro_batch * p.micro_batches == batch for p in plans)


def test_constants_match_the_job():
    from pyfast.models.gpt import VOCAB_PARALLEL_MIN
    from pyfast.parallel.p2p import MAX_MICROBATCHES, MAX_STAGES
    from pyfast.train.config import SCHEDULES
    assert S.VOCAB_PARALLEL_MIN == VOCAB_PARALLEL_MIN and set(S.SCHEDULES) == set(SCHEDULES)
    assert (S.MAX_STAGES, S.MAX_MICROBATCHES) == (MAX_STAGES, MAX_MICROBATCHES)


# ---- ranking and output

def test_ranking_is_by_time_to_target_then_memory(monkeypatch):
    """With a stand-in time model (a step falls with dp, compression costs extra steps), the
    order is known: the fastest to the target first, ties by memory (tie_band 0: no band)."""
    def fake_time(shape, plan, work, cluster):
        step = 1.0 / plan.dp + 0.1 * plan.pp + (0.01 if plan.activation_checkpointing else 0)
        factor = {"none": 1.0, "bf16": 1.0}.get(plan.compress, 1.3)
        return {"step_s": step, "compute_s": step, "comm_s": 0.0, "exposed_comm_s": 0.0,
                "bubble_s": 0.0, "recompute_s": 0.0, "codec_s": 0.0,
                "tokens_per_s": work.tokens / step, "steps_factor": factor}
    monkeypatch.setattr(S, "predict_time", fake_time)
    res = S.search(shapes.preset("gpt-small"), Workload(64, 16, "fp32"), build(4, 4, "h100"),
                   top=50, tie_band=0.0)
    keys = [s.key() for s in res.plans]
    assert keys == sorted(keys) and len(keys) == 50
    best = res.plans[0].plan
    assert (best.dp, best.pp, best.activation_checkpointing) == (4, 1, False)
    assert best.compress in ("none", "bf16") and res.plans[0].to_target_s == pytest.approx(0.35)


def test_json_schema_and_the_best_first(capsys):
    rc, out, err = plan(TINY + ["--json", "--top", "5"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert set(d) == {"plans", "rejected"} and len(d["plans"]) == 5
    for p in d["plans"]:
        assert list(p) == KEYS
        assert p["dp"] * p["cp"] * p["tp"] * p["pp"] == 2
        assert p["command"].startswith("pyfast train --model gpt-tiny ")
        assert p["command"].endswith("--nproc 2")
    steps = [p["step_s"] for p in d["plans"]]
    # the best within the tie band of the fastest (S.TIE_BAND: a tie goes to the simpler plan)
    assert steps[0] <= min(steps) * (1 + S.TIE_BAND)


def test_rejected_plans_say_how_much_memory_and_where(capsys):
    rc, out, err = plan(["--model", "gpt-7b", "--gpus", "8", "--seq", "4096",
                         "--global-batch", "64", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["rejected"] and all(r["command"] is None for r in d["rejected"])
    for r in d["rejected"]:
        assert list(r) == KEYS + ["reason"]
        assert r["memory_bytes_per_rank"] > GPUS["h100"].memory_bytes
        assert r["reason"].startswith("OOM by ") and " GiB on pp stage " in r["reason"]
    for p in d["plans"]:
        assert p["memory_bytes_per_rank"] <= GPUS["h100"].memory_bytes


def test_table_output_and_multinode_command(capsys):
    # gpt-70b: 4,233 configurations scored, most over memory (1.1 s); gpt-13b's 15K took 6 s
    rc, out, err = plan(["--model", "gpt-70b", "--gpus", "16", "--seq", "2048",
                         "--global-batch", "64", "--inter-bw", "10gbit", "--top", "3"], capsys)
    assert rc == 0, err
    assert "plans, best first" in out and "why" in out and "best: compute" in out
    assert "--nnodes 2 --node-rank $NODE_RANK --rdzv-endpoint $MASTER_ADDR:29500" in out
    assert "32,000-token vocabulary" in out  # the vocabulary note


def test_llama_plans_print_no_command(capsys):
    # no llama preset is `pyfast train`'s GPT (spec.gpt_model_flag): the smallest search that
    # shows it, llama-1b on 2 GPUs (0.1 s a call here; llama-70b on 64 GPUs took 5.5 s)
    argv = ["--model", "llama-1b", "--gpus", "2", "--seq", "4096", "--global-batch", "16",
            "--top", "2"]
    rc, out, err = plan(argv + ["--json"], capsys)
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert len(plans) == 2 and all(p["command"] is None for p in plans)
    rc, out, err = plan(argv, capsys)
    assert "cannot build it, so no command is printed" in out and "pyfast train --" not in out


def test_cluster_file(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text('gpus = 16\ngpus_per_node = 4\ninter_bw = "25gbit"\nmfu = 0.3\n'
                 '[gpu]\nbase = "a100-40gb"\nmemory_gib = 20\n')
    cl = build(cluster_file=str(f))
    assert (cl.gpus, cl.gpus_per_node, cl.inter_bps, cl.mfu) == (16, 4, 25e9 / 8, 0.3)
    assert cl.gpu.memory_bytes == 20 * 2**30 and cl.gpu.flops_16 == GPUS["a100-40gb"].flops_16
    assert build(8, cluster_file=str(f)).gpus == 8  # a flag overrides the file
    f.write_text('gpus = 8\n[gpu]\nmemory_gib = 20\n')
    with pytest.raises(ValueError, match="missing flops_16, flops_32, hbm, intra_bw"):
        build(cluster_file=str(f))
    f.write_text('gpus = 8\ngpu = "h100"\nlink = 3\n')
    with pytest.raises(ValueError, match=r"unknown keys \['link'\]"):
        build(cluster_file=str(f))


@pytest.mark.parametrize("argv,message", [
    (["--gpu", "b300"], "--gpu 'b300' is unknown"),
    (["--model", "gpt-9b"], "--model 'gpt-9b' is unknown"),
    (["--heads", "3"], "--heads 3 does not divide --hidden 64"),
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus 12 is not a multiple of --gpus-per-node 8"),
    (["--inter-bw", "fast"], "bandwidth 'fast'"),
    (["--model", "hf:/nonexistent/dir"], "no such directory"),
    (["--seq", "0"], "--seq must be >= 1"),
    (["--params", "1e9"], "--model PRESET|hf:DIR or as --params N (one of them)"),
    (["--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
    (["--model", "gpt-70b", "--gpus", "1", "--gpu", "h100"],
     "nothing fits: the smallest plan (dp 1 x cp 1 x tp 1 x pp 1"),
    # 16 GPUs: tp <= 4 heads, pp <= 2 layers, cp 1 (--seq 6 splits into 2 x cp chunks only for
    # cp 1... 6 % 4), so dp >= 2, which does not divide --global-batch 3
    (["--gpus", "16", "--gpus-per-node", "16", "--seq", "6", "--global-batch", "3"],
     "--global-batch 3 is not divisible by dp 2"),
])
def test_bad_input_exits_2_naming_the_problem(argv, message, capsys):
    rc, out, err = plan(TINY + argv, capsys)
    assert rc == 2 and message in err, err


def test_no_gpus_and_a_bad_cluster_file(tmp_path, capsys):
    rc, out, err = plan(["--model", "gpt-tiny", "--seq", "64", "--global-batch", "4"], capsys)
    assert rc == 2 and "--gpus N" in err
    f = tmp_path / "c.toml"
    f.write_text("gpus = [")
    rc, out, err = plan(["--model", "gpt-tiny", "--seq", "64", "--global-batch", "4",
                         "--cluster", str(f)], capsys)
    assert rc == 2 and "not valid TOML" in err
    rc, out, err = plan(["--model", "gpt-tiny", "--seq", "64", "--global-batch", "4",
                         "--cluster", str(tmp_path / "none.toml")], capsys)
    assert rc == 2 and "none.toml" in err


def test_nothing_fits_says_by_how_much(capsys):
    rc, out, err = plan(TINY[:2] + ["--model", "gpt-70b", "--gpus", "1", "--gpu", "h100",
                                    "--seq", "4096", "--global-batch", "8", "--offload", "none"],
                        capsys)
    assert rc == 2
    ratio = float(err.split("GiB a rank on pp stage 0, ")[1].split("x the")[0])
    assert ratio > 5  # 70B x 16 bytes of model state alone is ~13x one 80 GB GPU


def test_measure_and_calibrate_are_wired(monkeypatch, capsys, tmp_path):
    calls = []

    def measure(shape, work, cluster, link="loopback"):
        calls.append(("measure", shape.name, work.seq, link))
        return cluster.replace(calibration={"compute_scale": 2.0, "comm_scale": 1.0})

    def refit(cluster, rundir):
        calls.append(("refit", cluster.calibration["compute_scale"], rundir))
        return cluster
    monkeypatch.setitem(sys.modules, "pyfast.plan.calibrate",
                        types.SimpleNamespace(measure=measure, refit=refit))
    rc, out, err = plan(TINY + ["--measure", "1gbit", "--calibrate", str(tmp_path), "--json"],
                        capsys)
    assert rc == 0, err
    assert calls == [("measure", "gpt-tiny", 64, "1gbit"), ("refit", 2.0, str(tmp_path))]
    rc, out, err = plan(TINY + ["--measure", "--json"], capsys)
    assert calls[-1] == ("measure", "gpt-tiny", 64, "loopback")


def test_verify_compares_with_the_dry_run(capsys):
    # bf16, traced under the dry run's MetaAutocast (fp32 plans take the same path, no autocast)
    precision = "bf16"
    rc, out, err = plan(TINY[:-1] + [precision, "--top", "1", "--verify"], capsys)
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("--verify dp"))
    assert "predicted" in line and "traced" in line and "MiB" in line
    assert f"({precision}, vocab 256" in line


@pytest.mark.dist
def test_the_best_plans_command_runs(tmp_path, capsys):
    rc, out, err = plan(TINY + ["--json", "--top", "1"], capsys)
    assert rc == 0, err
    cmd = shlex.split(json.loads(out)["plans"][0]["command"])
    assert cmd[:2] == ["pyfast", "train"]
    # the command through the launcher's every check (--print-launch: no process started),
    # then its job on forked ranks (test_train.pool_train: a rank parses the same command
    # line, --nproc included; a launch cost ~6 CPU s more)
    from pyfast.train import main
    from test_train import pool_train
    argv = cmd[2:] + ["--steps", "2"]
    assert main(argv + ["--out", str(tmp_path), "--print-launch"]) == 0
    assert "torchrun --nproc-per-node 2 " in capsys.readouterr().out
    pool_train(tmp_path, 2, argv, base=())
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [1, 2]


def test_bench_plan_kinds_and_the_docs_table(tmp_path):
    from pyfast.benchmarks import plan as B
    # run_search's 10,000+ configurations are checked once, by bench/test_bench_plan.py's
    # smoke (gpt-7b on 16 GPUs, ~8 s): make test runs both suites
    assert [B.kind(p) for p in (Plan(dp=8), Plan(dp=2, tp=8), Plan(2, 1, 4, 2),
                                Plan(1, 1, 8, 8))] == ["dp", "tp+dp", "3d", "other"]
    doc = tmp_path / "plan.md"
    doc.write_text("# x\n## The folklore, checked\nintro\n<!-- table -->\nold\n## Next\nkept\n")
    row = {"size": "7b", "gpus": 8, "link": "10gbit", "plan": "dp1 tp8 8x1", "memory_bytes":
           2 * 2**30, "step_s": 1.5, "rule": "under 15B: data parallel", "agrees": "no",
           "differs": "needs 100 GiB", "why": ""}
    B.write_docs(str(doc), {"family": "gpt", "seq": 64, "global_batch": 8, "date": "d",
                            "pyfast": "0", "rows": [row]})
    text = doc.read_text()
    assert "intro\n<!-- table -->\n" in text and "old" not in text and text.endswith(
        "## Next\nkept\n")
    assert "| 7B | 8 | 10gbit | dp1 tp8 8x1 | 2 | 1.5 | under 15B: data parallel | **no** | " \
           "needs 100 GiB |" in text
