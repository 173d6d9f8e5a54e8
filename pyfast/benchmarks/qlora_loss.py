"""QLoRA against LoRA in loss (`pyfast bench qlora_loss`): does a 4-bit frozen base cost the
fine-tune its quality? Issue 31's target: QLoRA's loss after N steps within 2% of LoRA's.

A base worth fine-tuning first: a small random Llama (save_pretrained, read back as --model
hf:DIR) trained whole for `pretrain` steps and exported with `pyfast export --to hf`; then the
same adapters (rank R, all linear layers) fine-tuned on it with the base as built (fp32) and
stored nf4 (and int8), the same data, seed and steps, on 2 ranks (dp2). Recorded: the base's
validation loss, each run's final training and validation loss, and QLoRA's relative gap.
`--seeds 0,1`: the whole comparison under two seeds (the target holds only if both agree).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from pyfast import perf

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=688, vocab_size=256)  # bytes: the default data's vocabulary


def _train(args: list[str]) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "pyfast", "train", "--nproc", "2", "--dp", "2",
                        "--tensorboard", "off", "--no-plot", *args], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise RuntimeError(f"pyfast train {' '.join(args)}: exit {p.returncode}\n"
                           f"{p.stderr[-3000:]}")
    out = args[args.index("--out") + 1]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last(recs: list[dict], key: str) -> float:
    return [r[key] for r in recs if r.get(key) is not None][-1]


def one_seed(tmp: str, seed: int, pretrain: int, steps: int, rank: int, formats) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    init = os.path.join(tmp, f"init{seed}")
    LlamaForCausalLM(LlamaConfig(**SHAPE, max_position_embeddings=256, use_cache=False,
                                 tie_word_embeddings=False)).save_pretrained(init)
    common = ["--seq", "128", "--batch", "16", "--seed", str(seed), "--eval-batches", "8"]
    pre = os.path.join(tmp, f"pre{seed}")
    base_recs = _train(["--model", f"hf:{init}", "--steps", str(pretrain), "--lr", "3e-3",
                        "--eval-every", str(pretrain), "--out", pre, *common])
    base = os.path.join(tmp, f"base{seed}")
    subprocess.run([sys.executable, "-m", "pyfast", "export", pre, "--to", "hf", base],
                   check=True, capture_output=True)
    row = {"seed": seed, "base_val": _last(base_recs, "val_loss"), "runs": {}}
    for fmt in formats:
        flags = ["--lora", str(rank)] + ([] if fmt == "none" else ["--base-dtype", fmt])
        recs = _train(["--model", f"hf:{base}", "--steps", str(steps), "--lr", "2e-3",
                       "--eval-every", str(steps), "--out", os.path.join(tmp, f"ft{seed}{fmt}"),
                       *common, *flags])
        row["runs"][fmt] = {"loss": _last(recs, "loss"), "val_loss": _last(recs, "val_loss")}
    ref = row["runs"]["none"]["val_loss"]
    for fmt, r in row["runs"].items():
        r["val_gap"] = (r["val_loss"] - ref) / ref
    return row


def table(result: dict) -> str:
    lines = [f"# QLoRA vs LoRA loss: {result['machine']}, torch {result['torch']}",
             f"# base: Llama {result['shape']} pretrained {result['pretrain']} steps; adapters "
             f"r{result['rank']} on every linear layer, {result['steps']} steps, dp2, seq 128, "
             "batch 16, lr 2e-3",
             "| seed | base val | base as built: val | int8: val (gap) | nf4: val (gap) |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        r = row["runs"]
        cells = [f"{r[f]['val_loss']:.4f} ({100 * r[f]['val_gap']:+.2f}%)" if f in r else "-"
                 for f in ("int8", "nf4")]
        lines.append(f"| {row['seed']} | {row['base_val']:.4f} | {r['none']['val_loss']:.4f} | "
                     f"{cells[0]} | {cells[1]} |")
    worst = max(abs(row["runs"]["nf4"]["val_gap"]) for row in result["rows"])
    lines.append(f"\nnf4 (QLoRA) vs the base as built, worst over seeds: {100 * worst:.2f}% "
                 f"(target 2%: {'met' if worst <= 0.02 else 'MISSED'})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench qlora_loss", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--pretrain", type=int, default=300)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--formats", default="none,int8,nf4")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    import torch
    formats = a.formats.split(",")
    tmp = tempfile.mkdtemp(prefix="qlora_loss")
    try:
        rows = [one_seed(tmp, int(s), a.pretrain, a.steps, a.rank, formats)
                for s in a.seeds.split(",")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"machine": perf.machine(), "torch": torch.__version__, "shape": SHAPE,
              "pretrain": a.pretrain, "steps": a.steps, "rank": a.rank, "rows": rows}
    text = table(result)
    print(text)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(a.out + ".txt", "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
