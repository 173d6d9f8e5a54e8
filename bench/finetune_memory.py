"""Issue 31's fine-tuning memory targets, from `pyfast train --dry-run` (meta tensors: no
values, the job's own step; pyfast.train.dryrun): an 8B Llama config (/tmp/llama8b, written by
this script) with LoRA 16, bf16 autocast, activation checkpointing, seq 2048, 2 sequences a
rank, --zero 3 with the frozen base sharded, with and without --loss-chunks.

    PYTHONPATH=$PWD python bench/finetune_memory.py   -> bench/results/finetune_memory.{txt,json}
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

CONFIG = "/tmp/llama8b"
BASE = ("--zero 3 --base-placement shard --model hf:{cfg} --lora 16 --seq 2048 --batch {batch} "
        "--activation-checkpointing --precision bf16 --base-dtype {dtype}")
ROWS = [(n, dtype, k) for n in (2, 4) for dtype in ("bf16", "nf4") for k in (0, 8)] + \
    [(2, dtype, 16) for dtype in ("bf16", "nf4")]
KINDS = ("parameters", "gradients", "optimizer", "activations", "comm_buffers", "feedback")


def main() -> int:
    from transformers import LlamaConfig

    from pyfast.train.config import from_args, parser
    from pyfast.train.dryrun import dry_run
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained(CONFIG)
    out, lines = [], []
    for n, dtype, k in ROWS:
        flags = f"--nproc {n} --dp {n} " + BASE.format(cfg=CONFIG, batch=2 * n, dtype=dtype) + \
            (f" --loss-chunks {k}" if k else "")
        argv = flags.split()
        ns = parser().parse_args(argv + ["--dry-run"])
        t0 = time.perf_counter()
        rows = dry_run(from_args(ns), n, [0])
        r = rows[0]
        out.append({"command": "pyfast train --dry-run " + flags, "nproc": n, "base_dtype": dtype,
                    "loss_chunks": k, "wall_s": round(time.perf_counter() - t0, 1), **r})
        print(out[-1], file=sys.stderr, flush=True)
    gib = lambda b: f"{b / 2**30:6.2f}"  # noqa: E731
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines += [f"# pyfast train --dry-run (meta tensors, torch {torch.__version__}, "
              f"{platform.machine()}; rank 0; GiB = 2^30 bytes); {stamp}",
              "# 8B Llama config (vocab 128,256, hidden 4096, 32 layers, GQA 8), seq 2048, "
              "2 sequences a rank (--batch 2 x nproc)",
              "# flags: --nproc N --dp N " + BASE.format(cfg=CONFIG, batch="2N", dtype="D")
              + " [--loss-chunks K]",
              "# targets (issue 31, 2 ranks): LoRA (bf16 base) <= 12 GiB, QLoRA (nf4 base) <= 6 GiB",
              f"{'nproc':>5} {'base':>5} {'chunks':>6} {'peak':>6} " +
              " ".join(f"{k[:8]:>8}" for k in KINDS)]
    for r in out:
        lines.append(f"{r['nproc']:>5} {r['base_dtype']:>5} {r['loss_chunks']:>6} "
                     f"{gib(r['peak_bytes'])} " + " ".join(f"{gib(r[k]):>8}" for k in KINDS))
    targets = {"bf16": 12, "nf4": 6}  # GiB a rank on 2 ranks (issue 31)
    for dtype, cap in targets.items():
        best = min((r for r in out if r["nproc"] == 2 and r["base_dtype"] == dtype),
                   key=lambda r: (r["peak_bytes"], r["loss_chunks"]))
        left = best["peak_bytes"] - cap * 2**30
        lines.append(f"# 2 ranks, base {dtype}: best {gib(best['peak_bytes']).strip()} GiB "
                     f"(--loss-chunks {best['loss_chunks']}) vs target {cap} GiB: "
                     + ("met" if left <= 0 else f"NOT met, {left / 2**30:.2f} GiB over; "
                        + ", ".join(f"{k} {gib(best[k]).strip()}" for k in KINDS if best[k])))
    res = Path(__file__).parent / "results"
    (res / "finetune_memory.txt").write_text("\n".join(lines) + "\n")
    (res / "finetune_memory.json").write_text(json.dumps({"time": stamp, "torch": torch.__version__,
                                                          "rows": out}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
