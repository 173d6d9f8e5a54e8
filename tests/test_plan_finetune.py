"""`pyfast plan --finetune`: LoRA / QLoRA plans (pyfast/plan/finetune.py): the adapter count
against peft's, the stored base against quant_base's, the cases of issue 31 through the CLI,
bad input, every LoRA plan's flags through the job's checks, and one dry run."""
import json
import shlex

import pytest

from pyfast.plan import finetune as FT, search as S, shapes
from pyfast.plan.cluster import build
from pyfast.plan.memory import predict_memory
from pyfast.plan.spec import Plan, Workload
from pyfast.plan.timing import predict_time
from plan_utils import plan

L40S = ["--model", "llama-7b", "--gpus", "2", "--gpu", "l40s", "--seq", "2048",
        "--global-batch", "16"]
B70 = ["--model", "llama-2-70b", "--gpus", "2", "--gpu", "rtx4090", "--seq", "2048",
       "--global-batch", "16"]
GiB = 2**30


# ---- the arithmetic against the code it models

def test_adapter_count_is_peft_s():
    """r (in + out) per adapted Linear, counted by the model against peft's trainable
    parameters on pyfast's GPT (all-linear: qkv, proj, fc, mlp.proj)."""
    import torch
    from pyfast.models import build
    from pyfast.models.lora import LoraOptions, apply_lora
    shape = shapes.resolve("gpt-tiny", None)
    for r in (1, 3, 8):
        torch.manual_seed(0)
        m = build("gpt-tiny", 256, 32)
        apply_lora(m, LoraOptions(r))
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        assert shape.adapter_params(r) == trainable, r
    # Llama's seven Linears a layer: q, o h x h; k, v h x kv; gate, up h x f; down f x h
    s = shapes.preset("llama-8b")
    h, kv, f = 4096, 1024, 14336
    assert s.adapter_params(16) == 32 * 16 * (2 * 2 * h + 2 * (h + kv) + 3 * (h + f))


def test_stored_base_is_quant_base_s():
    """bf16 2 bytes, int8 1 byte + an fp32 absmax per 64 (8.5 bits), nf4 4.5 bits: the bytes
    QuantLinear keeps (meta tensors: sizes only)."""
    import torch
    from pyfast.models.quant_base import quantize_weight
    w = torch.empty(96, 200, device="meta")  # 19,200: 300 blocks of 64
    for fmt in ("bf16", "int8"):
        codes, scales = quantize_weight(w, fmt)
        assert FT.stored_bytes(w.numel(), fmt, 4) == \
            codes.numel() * codes.element_size() + scales.numel() * 4, fmt
    assert FT.stored_bytes(19200, "nf4", 2) == 9600 + 4 * 300
    assert FT.stored_bytes(19201, "nf4", 2) == 9601 + 4 * 301   # ragged: ceil each
    assert FT.stored_bytes(64, "none", 4) == 256


def test_lora_memory_orders_and_shards():
    """On the 8B shape: full > lora > qlora int8 > qlora nf4; sharding the base over more ranks
    only lowers it; the base has no gradient or optimizer state."""
    shape, work = shapes.preset("llama-8b"), Workload(2048, 4, "bf16")
    base = Plan(dp=2, zero=3, micro_batch=2, activation_checkpointing=True)

    def peak(**kw):
        return predict_memory(shape, base.replace(**kw), work)
    full, lora = peak(), peak(lora=16, base_dtype="bf16", base_placement="shard")
    q8 = peak(lora=16, base_dtype="int8", base_placement="shard")
    q4 = peak(lora=16, base_dtype="nf4", base_placement="shard")
    assert full["peak_bytes"] > lora["peak_bytes"] > q8["peak_bytes"] > q4["peak_bytes"]
    A = shape.adapter_params(16)
    assert lora["state"]["gradients"] == pytest.approx(4 * A / 2, rel=1e-6)
    assert lora["state"]["optimizer"] == pytest.approx(8 * A / 2, abs=4 * 2 * 7 * 32 + 8)
    rep = peak(lora=16, base_dtype="nf4", base_placement="replicate")
    # the adapters are ZeRO-3 shards either way; only the base's placement differs
    # (the head's weight in bf16, as the job stores a frozen Linear under bf16)
    assert rep["parameters"] - q4["parameters"] == \
        FT.base_bytes(shape, "nf4", 2, head=FT.head_weight_bytes("bf16")) // 2
    four = predict_memory(shape, base.replace(dp=4, lora=16, base_dtype="nf4",
                                              base_placement="shard"), Workload(2048, 8))
    assert four["peak_bytes"] < q4["peak_bytes"]
    with pytest.raises(ValueError, match="dp-only"):
        predict_memory(shape, Plan(tp=2, lora=16), work)
    with pytest.raises(ValueError, match="only ZeRO 3"):
        predict_memory(shape, Plan(dp=2, lora=16, base_placement="shard"), work)


def test_lora_time_backward_skips_weight_gradients():
    shape, work, cl = shapes.preset("llama-7b"), Workload(2048, 16), build(2, 2, "l40s")
    p = Plan(dp=2, zero=3, micro_batch=1, micro_batches=8, activation_checkpointing=True)
    full = predict_time(shape, p, work, cl)
    rep = predict_time(shape, p.replace(lora=16, base_dtype="bf16"), work, cl)
    shard = predict_time(shape, p.replace(lora=16, base_dtype="bf16", base_placement="shard"),
                         work, cl)
    nf4 = predict_time(shape, p.replace(lora=16, base_dtype="nf4", base_placement="shard"),
                       work, cl)
    assert rep["compute_s"] < 0.85 * full["compute_s"]
    assert rep["zero_comm_s"] < 0.05 * full["zero_comm_s"]   # adapters only
    # the sharded base's gathers: bf16 bytes (half of full's fp32), nf4 about a quarter of that
    assert 0.3 < shard["zero_comm_s"] / full["zero_comm_s"] < 0.7
    assert nf4["zero_comm_s"] < 0.45 * shard["zero_comm_s"]


# ---- the CLI: issue 31's cases

def test_l40s_lora_fits_and_prints_its_command(capsys):
    rc, out, err = plan(L40S + ["--offload", "none"], capsys)  # (with it: offload plans)
    assert rc == 2 and "nothing fits" in err and "--finetune lora or qlora" in err
    rc, out, err = plan(L40S + ["--finetune", "lora"], capsys)
    assert rc == 0, err
    assert "lora 16, bf16 base" in out
    cmd = out.strip().splitlines()[-1]
    assert cmd.startswith("pyfast train --model hf:Llama-2-7b-hf --dp 2 ")
    assert "--lora 16 --base-dtype bf16" in cmd and cmd.endswith("--nproc 2")
    assert "--loss-chunks" not in cmd   # the unchunked loss fits: chunking would only cost time
    assert "huggingface-cli download meta-llama/Llama-2-7b-hf" in out
    rc, out_auto, err = plan(L40S + ["--finetune", "auto"], capsys)
    assert rc == 0 and out_auto.strip().splitlines()[-1] == cmd
    assert "note: --finetune auto: no full plan fits" in out_auto and "49.4 GiB" in out_auto
    rc, js, err = plan(L40S + ["--finetune", "auto", "--json", "--lora-rank", "8"], capsys)
    d = json.loads(js)["plans"]
    assert all(p["finetune"] == "lora" and p["lora"] == 8 for p in d)
    assert all(p["memory_bytes_per_rank"] <= 46068 * 2**20 for p in d)
    assert d[0]["adapter_params"] == shapes.preset("llama-7b").adapter_params(8)


def test_70b_on_two_24gb_gpus_reports_the_smallest_qlora_plan(capsys):
    # (on the GPUs alone: with host offload it fits, tests/test_plan_offload.py)
    rc, out, err = plan(B70 + ["--finetune", "auto", "--offload", "none"], capsys)
    assert rc == 2 and "nothing fits" in err
    assert "zero 3" in err and "qlora 16, nf4 base sharded" in err and "recompute" in err
    need = float(err.split("needs ")[1].split(" GiB")[0])
    assert 24 < need < 40
    # on four of them it fits: the plan is QLoRA on the sharded nf4 base
    four = list(B70)
    four[3] = "4"
    rc, out, err = plan(four + ["--finetune", "auto", "--json"], capsys)
    assert rc == 0, err
    best = json.loads(out)["plans"][0]
    assert (best["zero"], best["base_dtype"], best["base_placement"]) == (3, "nf4", "shard")
    assert "--lora 16 --base-dtype nf4 --base-placement shard" in best["command"]


@pytest.mark.parametrize("argv,msg", [
    (["--finetune", "lora", "--lora-rank", "0"], "--lora-rank must be >= 1"),
    (["--finetune", "qlora", "--lora-rank", "-3"], "--lora-rank must be >= 1"),
    (["--lora-rank", "8"], "--finetune full: a full fine-tune has no adapters"),
    (["--finetune", "adapters"], "invalid choice: 'adapters'"),
])
def test_bad_input(argv, msg, capsys):
    rc, out, err = plan(L40S + argv, capsys)
    assert rc == 2 and msg in err, err


def test_every_lora_plan_passes_the_jobs_checks():
    """Each LoRA plan's train flags parse and pass pyfast.train.config's checks."""
    from pyfast.train.config import from_args, parser
    shape, work = shapes.preset("gpt-small"), Workload(64, 8, "bf16")
    seen = set()
    for kind in ("lora", "qlora"):
        for mesh in S.meshes(4):
            for group in S.mesh_plans(shape, work, *mesh, S.finetune_variants(kind, work, 4)):
                for p in group:
                    assert p.lora == 4 and (p.tp, p.cp, p.pp) == (1, 1, 1)
                    cfg = from_args(parser().parse_args(p.train_flags("gpt-small", work)))
                    assert (cfg.lora, cfg.base_dtype, cfg.zero, cfg.loss_chunks) == \
                        (4, p.base_dtype, p.zero, p.loss_chunks)
                    seen.add((p.zero, p.base_dtype, p.base_placement, p.loss_chunks))
    assert {(3, "nf4", "shard", 0), (3, "nf4", "shard", S.LOSS_CHUNKS),
            (3, "int8", "replicate", 0), (0, "bf16", "replicate", S.LOSS_CHUNKS)} <= seen
    assert all(pl == "replicate" for z, _, pl, _ in seen if z != 3)
    # never on a tp or pp mesh (the job refuses --loss-chunks there); full plans never chunk
    for mesh in S.meshes(4):
        for group in S.mesh_plans(shape, work, *mesh, S.finetune_variants("full", work)):
            assert not any(p.loss_chunks for p in group)


def test_small_gpu_8b_qlora_chunks_its_loss(tmp_path, capsys):
    """llama-8b QLoRA on two 7 GiB GPUs, 2 sequences a rank: no unchunked plan fits (the
    [tokens x 128,256] fp32 log-softmax and its gradient), a --loss-chunks 8 plan does; its
    command says so and its memory is the chunked model's."""
    (tmp_path / "c.toml").write_text('gpus = 2\ngpus_per_node = 2\n[gpu]\nbase = "rtx4090"\n'
                                     'memory_gib = 7\n')
    argv = ["--model", "llama-8b", "--cluster", str(tmp_path / "c.toml"), "--seq", "2048",
            "--global-batch", "4", "--finetune", "qlora"]
    rc, out, err = plan(argv, capsys)
    assert rc == 0, err
    cmd = out.strip().splitlines()[-1]
    assert "--base-dtype nf4 --base-placement shard --loss-chunks 8" in cmd, cmd
    rc, js, err = plan(argv + ["--json"], capsys)
    best = json.loads(js)["plans"][0]
    assert best["loss_chunks"] == 8 and "--loss-chunks 8" in best["command"]
    shape, work = shapes.preset("llama-8b"), Workload(2048, 4, "bf16")
    p = Plan(dp=2, zero=best["zero"], micro_batch=best["micro_batch"],
             micro_batches=best["micro_batches"],
             activation_checkpointing=best["activation_checkpointing"], lora=16,
             base_dtype="nf4", base_placement="shard", loss_chunks=8)
    chunked = predict_memory(shape, p, work)["peak_bytes"]
    plain = predict_memory(shape, p.replace(loss_chunks=0), work)["peak_bytes"]
    assert best["memory_bytes_per_rank"] == chunked <= 7 * GiB < plain
    # one chunk's log-softmax and dlogits (12 bytes a token and vocab entry) instead of all
    tok = p.micro_batch * 2048
    assert plain - chunked >= 0.5 * 12 * 128256 * (tok - tok // 8)


def test_loss_chunks_cost_the_heads_forward_again():
    shape, work, cl = shapes.preset("llama-8b"), Workload(2048, 4), build(2, 2, "rtx4090")
    p = Plan(dp=2, zero=3, micro_batch=2, activation_checkpointing=True, lora=16,
             base_dtype="nf4", base_placement="shard")
    plain, chunked = predict_time(shape, p, work, cl), \
        predict_time(shape, p.replace(loss_chunks=8), work, cl)
    head_fwd = 2.0 * 128256 * 4096 * 4096 / (cl.gpu.flops_16 * cl.mfu)
    extra = chunked["recompute_s"] - plain["recompute_s"]
    assert head_fwd <= extra < 1.5 * head_fwd
    assert chunked["step_s"] > plain["step_s"]


def test_dry_run_agrees_on_a_lora_gpt():
    """The dry run (fp32, DataParallel: what runs today) against the model, within 10%."""
    from pyfast.benchmarks.plan_memory import plan_of
    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import dry_run
    cfg = TrainConfig(model="gpt:layers=2,heads=4,hidden=256", dp=2, seq=256, batch=4, lora=8,
                      activation_checkpointing=True)
    traced = dry_run(cfg, cfg.ranks, [0])[0]["peak_bytes"]
    pred = predict_memory(*plan_of(cfg), device="meta")["peak_bytes"]
    assert abs(pred / traced - 1) < 0.10, (pred, traced)
    assert shlex.split(" ".join(plan_of(cfg)[1].train_flags("x", plan_of(cfg)[2])))[-2:] == \
        ["--lora", "8"]


def test_constants_and_new_presets_match_their_sources():
    from pyfast.models.quant_base import BLOCK, FORMATS
    from pyfast.train.config import BASE_DTYPES, BASE_PLACEMENTS
    assert FT.QBLOCK == BLOCK and set(FT.QLORA_DTYPES) | {"bf16"} == set(FORMATS)
    assert FT.BASE_DTYPES == BASE_DTYPES and set(FT.PLACEMENTS) < set(BASE_PLACEMENTS)
    # Llama 3.1 8B 8.03B, Llama 2 70B 69.0B (their model cards)
    assert round(shapes.preset("llama-8b").params() / 1e9, 2) == 8.03
    assert round(shapes.preset("llama-2-70b").params() / 1e9, 1) == 69.0
    assert set(shapes.HF_REPOS) == {n for n in shapes.PRESETS if n.startswith("llama-")}


def test_lora_kinds_need_a_dp_only_mesh(capsys):
    """A global batch dp cannot split leaves LoRA no mesh: said so; auto then reports the full
    plans' smallest without suggesting the kinds it already tried."""
    odd = L40S[:-1] + ["3"]
    rc, out, err = plan(odd + ["--finetune", "lora"], capsys)
    assert rc == 2 and "(--finetune lora: dp-only meshes" in err and "not divisible by dp 2" in err
    rc, out, err = plan(odd + ["--finetune", "auto", "--offload", "none"], capsys)
    assert rc == 2 and "nothing fits" in err and "--finetune lora or qlora" not in err


@pytest.mark.parametrize("kw", [dict(base_dtype="nf4", zero=3, base_placement="shard"),
                                dict(base_dtype="int8", zero=3, base_placement="replicate")])
def test_dry_run_agrees_on_a_small_hf_llama_qlora(kw, tmp_path):
    """A small Llama (GQA, SwiGLU) as hf:DIR, bf16, recompute, QLoRA under ZeRO 3 with the base
    sharded or replicated: the dry run's peak within 10% of the model's."""
    from pyfast.plan.shapes import from_hf
    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import dry_run
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 768,
           "vocab_size": 2048, "tie_word_embeddings": False, "max_position_embeddings": 1024,
           "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tc = TrainConfig(model=f"hf:{tmp_path}", dp=2, seq=256, batch=4, lora=8, precision="bf16",
                     activation_checkpointing=True, **kw)
    traced = dry_run(tc, 2, [0])[0]["peak_bytes"]
    plan = Plan(dp=2, micro_batch=2, activation_checkpointing=True, lora=8, **kw)
    pred = predict_memory(from_hf(str(tmp_path)), plan, Workload(256, 4, "bf16"),
                          "meta")["peak_bytes"]
    assert abs(pred / traced - 1) < 0.10, (pred, traced)
