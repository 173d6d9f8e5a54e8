"""LoRA against a full fine-tune (`pyfast bench lora`): the same Hugging Face Llama, data and
global batch through `pyfast train --nproc 2 --dp 2`, with and without --lora R, each run
twice, alternating (lora, full, lora, full) so that a load change on a shared machine hits both.
Recorded: bench/results/lora_vs_full.json / .txt (`pyfast bench lora --out
bench/results/lora_vs_full`; 4 minutes on a 2-core VM (Intel Xeon, /proc/cpuinfo), torch 2.13
CPU, gloo, shared with other jobs).

The model: a random LlamaForCausalLM saved with save_pretrained (safetensors + config.json) and
read back as --model hf:DIR, as a user's model would be: hidden 768, 12 layers, 12 heads, 4
key/value heads (GQA), MLP 2048, vocabulary 16,384 (about 100M parameters, the shape of a small
Llama). The data: the default (the Python standard library's sources, read as bytes).

Per run: tokens/s (the median of the steps after the first, which warms up), step ms, the
job's bytes sent per step over both ranks, peak RSS (the larger rank's: its model, gradients,
optimizer state, activations), trainable parameters, the size of the final checkpoint (LoRA:
adapters and their optimizer state only; full: every weight and its AdamW moments) and the
run's wall time (start-up, steps, validation and that checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pyfast import perf

SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=16384)


def make_model(d: str, seq: int) -> int:
    """A random Llama of SHAPE saved under d; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, max_position_embeddings=seq, use_cache=False,
                         tie_word_embeddings=False)
    m = LlamaForCausalLM(config)
    m.save_pretrained(d)
    return sum(p.numel() for p in m.parameters())


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def one_run(model_dir: str, out: str, flags: list[str], common: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pyfast", "train", "--model", f"hf:{model_dir}", "--nproc", "2",
           "--dp", "2", *common, "--out", out, *flags]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    timed = recs[1:] or recs
    ck = os.path.join(out, "checkpoints")
    last = os.path.join(ck, sorted(os.listdir(ck), key=lambda s: int(s.split("-")[-1]))[-1])
    meta = json.load(open(os.path.join(last, "meta.json")))
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_ms": statistics.median(r["step_ms"] for r in timed),
            "mb_sent_per_step": statistics.median(r["bytes_sent"] for r in timed) / 1e6,
            "peak_rss_mb": max(r["max_rss_mb"] for r in recs),
            "trainable_params": meta.get("trainable_params", meta["n_params"]),
            "n_params": meta["n_params"], "checkpoint_mb": _size(last) / 1e6,
            "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"], "wall_s": wall}


def run(rank: int = 16, steps: int = 6, batch: int = 4, seq: int = 64, repeats: int = 2) -> dict:
    common = ["--steps", str(steps), "--batch", str(batch), "--seq", str(seq), "--seed", "0",
              "--warmup", "1", "--eval-batches", "1", "--no-tensorboard", "--no-plot"]
    configs = {f"lora r{rank}": ["--lora", str(rank)], "full": []}
    rows, load = [], os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pyfast-bench-lora-") as tmp:
        model_dir = os.path.join(tmp, "llama")
        n = make_model(model_dir, seq)
        for i in range(repeats):
            for name, flags in configs.items():  # alternating: a load change hits both
                out = os.path.join(tmp, f"{name.replace(' ', '_')}-{i}")
                r = one_run(model_dir, out, flags, common)
                shutil.rmtree(out, ignore_errors=True)  # a full checkpoint: 1.2 GB
                rows.append({"config": name, "run": i + 1, **r})
                print(f"{name} run {i + 1}: {r['tokens_per_s']:.0f} tok/s, "
                      f"{r['peak_rss_mb']:.0f} MB peak RSS", file=sys.stderr, flush=True)
    return {"benchmark": "lora", "machine": perf.machine() + "; 2 ranks (--dp 2) over gloo, "
            f"load average {load[0]:.1f} before / {os.getloadavg()[0]:.1f} after (a machine "
            "shared with other jobs: compare rows of one run, not runs of different days)",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model": {"hf": "LlamaForCausalLM", **SHAPE, "parameters": n},
            "flags": common, "rows": rows}


def table(result: dict):
    t = perf.rich_table(f"LoRA vs full fine-tune, {result['model']['parameters'] / 1e6:.0f}M "
                        "Llama, dp2", result,
                        ("config", "run", "tokens/s", "step ms", "MB sent/step", "peak RSS MB",
                         "trainable", "ckpt MB", "loss first -> last", "wall s"),
                        left=("config",))
    for r in result["rows"]:
        t.add_row(r["config"], str(r["run"]), f"{r['tokens_per_s']:.0f}", f"{r['step_ms']:.0f}",
                  f"{r['mb_sent_per_step']:.1f}", f"{r['peak_rss_mb']:.0f}",
                  f"{r['trainable_params'] / 1e6:.2f}M", f"{r['checkpoint_mb']:.1f}",
                  f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}", f"{r['wall_s']:.0f}")
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    return perf.finish(run(a.rank, a.steps, a.batch, a.seq, a.repeats), table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
