"""ZeRO-3 with a LoRA model's frozen base sharded (zero(frozen="shard")), the base stored as bf16,
int8 or nf4: the bytes the frozen all-gathers move a step, and the step time, on 2 ranks x 1
thread over an emulated link (pyfast.netns: tbf on the namespace's loopback).

    python -m pyfast.benchmarks.zero_frozen [--link 1gbit] [--runs 2] [--out bench/results/zero_frozen]

Model: an HF LlamaForCausalLM built from a config (MODEL; 256 byte tokens, so the embedding and
head are a small part of the base), rank-8 LoRA on every linear of the layers (peft), the
adapted Linear weights quantized (pyfast.models.quant_base), the embedding and norms in bf16 in
all three (as the job stores them under --precision bf16), the head fp32 (0.8 MB).
Step: forward + backward + AdamW step + zero_grad, fp32 compute; the three bases are built in
one launch and step in turn (round robin: the same load on the shared machine); median over the
timed steps of the slowest rank's step. Bytes: `gather_bytes`, what one rank's frozen
all-gathers receive a step (W x S bytes a unit and gather, counted on the FrozenUnits);
`link_bytes`, everything the namespace's lo carried in the step (both ranks, every collective).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile

from pyfast import netns, perf
from pyfast._io import atomic_write_text

FORMATS = ("bf16", "int8", "nf4")
MODEL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, intermediate_size=2048)  # ~85M parameters, vocab 256
VOCAB, RANK, LR = 256, 8, 1e-4


def build(fmt: str, seq: int, model: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pyfast.models.hf import LLAMA_TP_FIELDS, LLAMA_TP_PLAN, HFCausalLM
    from pyfast.models.lora import LoraOptions, apply_lora
    from pyfast.models.quant_base import quantize_base
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=seq, use_cache=False,
                         pad_token_id=None, tie_word_embeddings=False, attn_implementation="sdpa",
                         **model)
    m = HFCausalLM(LlamaForCausalLM(config), LLAMA_TP_PLAN, LLAMA_TP_FIELDS)
    apply_lora(m, LoraOptions(RANK))
    quantize_base(m, fmt)
    head = m.hf.lm_head.weight
    with torch.no_grad():
        for n, p in m.named_parameters():  # QuantLinear's scales stay fp32
            if p.dtype == torch.float32 and not (p.requires_grad or n.endswith(".scales")
                                                 or p is head):
                p.data = p.data.to(torch.bfloat16)
    # fp32 compute: the bf16 embedding's rows as fp32 (the norms' bf16 weights multiply fp32
    # activations into fp32); the head stays fp32 (0.8 MB at vocab 256)
    m.hf.model.embed_tokens.register_forward_hook(lambda mod, args, out: out.float())
    return m


def _worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyfast.parallel import zero
    job = json.loads(os.environ["PYFAST_ZERO_FROZEN"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randint(0, VOCAB, (job["batch"], job["seq"] + 1), generator=g)
            for _ in range(4)]
    emulated = bool(os.environ.get("PYFAST_NETNS"))  # else lo is the host's: not counted
    provs, counted = {}, {}
    for fmt in job["formats"]:
        net, opt = zero(build(fmt, job["seq"], job["model"]), torch.optim.AdamW, stage=3,
                        frozen="shard", lr=LR)
        counted[fmt] = [0]
        for fu in net.frozen:  # count each gather's W x S bytes as it starts
            def start(*a, fu=fu, orig=fu.start_gather, c=counted[fmt]):
                c[0] += fu.world * fu.S
                return orig(*a)
            fu.start_gather = start
        provs[fmt] = (net, opt)
    times = {f: [] for f in provs}
    sent = {f: [] for f in provs}
    gathered = {f: [] for f in provs}
    loss0 = {}
    for i in range(job["warmup"] + job["steps"]):
        t = data[i % len(data)]
        x, y = t[:, :-1], t[:, 1:]
        for fmt, (net, opt) in provs.items():
            dist.barrier()
            s0, c0 = netns.lo_tx_bytes() if emulated else 0, counted[fmt][0]
            t0 = perf.clock(x.device)
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = perf.clock(x.device) - t0
            dist.barrier()
            if i == 0:
                loss0[fmt] = float(loss)
            if i >= job["warmup"]:
                times[fmt].append(dt)
                sent[fmt].append(netns.lo_tx_bytes() - s0 if emulated else float("nan"))
                gathered[fmt].append(counted[fmt][0] - c0)
    rows = []
    for fmt, (net, _) in provs.items():
        each = [None] * dist.get_world_size()
        dist.all_gather_object(each, times[fmt])
        per_step = [max(ts) for ts in zip(*each)]
        stored, whole = net.frozen_bytes()
        rows.append({"base": fmt, "loss0": loss0[fmt], "times": per_step,
                     **perf.summary(per_step), "link_bytes": statistics.median(sent[fmt]),
                     "gather_bytes": statistics.median(gathered[fmt]),
                     "frozen_stored": stored, "frozen_whole": whole})
        net.close()
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(rows))
    netns.finish_group()


def run(link: str = "1gbit", runs: int = 2, batch: int = 1, seq: int = 32, steps: int = 5,
        warmup: int = 1, model: dict | None = None, timeout: float = 1800) -> dict:
    model = model or MODEL
    job = {"formats": list(FORMATS), "batch": batch, "seq": seq, "steps": steps,
           "warmup": warmup, "model": model, "timeout": timeout}
    results = []
    for r in range(runs):
        with tempfile.TemporaryDirectory() as d:
            j = {**job, "out": os.path.join(d, "r.json")}
            netns.run_ranks(["-c", "from pyfast.benchmarks.zero_frozen import _worker; _worker()"],
                            2, link, timeout, env={"PYFAST_ZERO_FROZEN": json.dumps(j)})
            with open(j["out"]) as f:
                rows = json.load(f)
        ref = next(x for x in rows if x["base"] == "bf16")
        for x in rows:
            x["run"] = r + 1
            x["bytes_vs_bf16"] = ref["gather_bytes"] / x["gather_bytes"]
            x["speedup_vs_bf16"] = ref["median_s"] / x["median_s"]
            bps = netns.rate_bps(link)  # None on plain loopback: no floor
            x["floor_s"] = x["link_bytes"] * 8 / bps if bps else float("nan")
        results += rows
    n = sum(p.numel() for p in build("bf16", seq, model).parameters())
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "link": f"{link} (tbf on the namespace's loopback, both directions share it)",
            "world": 2, "threads_per_rank": 1, "batch": batch, "seq": seq, "steps": steps,
            "warmup": warmup, "model": f"HF Llama {model}, vocab {VOCAB}, {n / 1e6:.1f}M params, "
                                      f"LoRA rank {RANK} all-linear, fp32 compute",
            "rows": results}


def text(res: dict) -> str:
    lines = [f"ZeRO-3, LoRA, frozen base sharded (zero(frozen='shard')): {res['model']}",
             f"{res['machine']}; 2 ranks x 1 thread, gloo, link {res['link']}; batch "
             f"{res['batch']} x {res['seq']} tokens a rank; median of {res['steps']} steps after "
             f"{res['warmup']} warm-up, slowest rank", "",
             f"{'run':>3} {'base':>5} {'gather MB/step/rank':>20} {'x fewer':>8} "
             f"{'link MB/step':>13} {'floor s':>8} {'step s':>7} {'x faster':>9} {'loss0':>8}"]
    for r in res["rows"]:
        lines.append(f"{r['run']:>3} {r['base']:>5} {r['gather_bytes'] / 1e6:>20.1f} "
                     f"{r['bytes_vs_bf16']:>8.2f} {r['link_bytes'] / 1e6:>13.1f} "
                     f"{r['floor_s']:>8.2f} {r['median_s']:>7.3f} {r['speedup_vs_bf16']:>9.2f} "
                     f"{r['loss0']:>8.4f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    p.add_argument("--out", default="bench/results/zero_frozen")
    a = p.parse_args(argv)
    res = run(a.link, a.runs, seq=a.seq, steps=a.steps,
              model={**MODEL, "num_hidden_layers": a.layers})
    atomic_write_text(a.out + ".json", json.dumps(res, indent=1))
    atomic_write_text(a.out + ".txt", text(res))
    print(text(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
