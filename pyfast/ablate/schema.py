"""What an ablation writes, in one place (the runner writes it, the report reads it).

DIR/results.csv: one row per cell, the columns COLUMNS in this order. Empty string = not
measured / not applicable (e.g. lo_bytes_per_step on plain loopback, time_to_target_s when the
target was not reached). status: "done", "skipped" (reason says why, e.g. a link that needs
root), "diverged" (NaN/Inf loss: reason has the step), "failed" (a rank crashed: reason has the
error's last line).

DIR/cells/<cell>.jsonl: one JSON object per optimizer step of that cell, keys STEP_KEYS
(t_s: training seconds so far, the sum of step times, evaluation and probes excluded).
"""
from __future__ import annotations

import csv
import os

# the cell's flags (what makes it this cell), then its measurements, then where it ran
FLAGS = ("task", "spec", "error_feedback", "bucket_mb", "link", "world", "seed", "steps",
         "target_loss")
MEASURED = (
    "status", "reason",
    "final_loss",          # mean train loss of the last 10 steps
    "val_loss",            # validation loss after the last step
    "reached",             # "yes" / "no": smoothed train loss <= target_loss at some step
    "steps_to_target",     # first step whose smoothed loss (mean of the last 10) <= target
    "time_to_target_s",    # t_s at that step
    "train_s",             # t_s at the last step
    "step_ms",             # median step time
    "compute_ms",          # median forward+backward+optimizer with no reduction (probe)
    "encode_ms",           # compress() of every bucket, once per step (codec probe)
    "decode_ms",           # decompress / decode-add of every bucket, once per step
    "comm_ms",             # median sum over buckets of the reduction's own time
    "exposed_comm_ms",     # median time the step waited for communication
    "wire_bytes_per_step",  # bytes one rank's compressed collectives put on the wire (model)
    "proc_bytes_per_step",  # bytes one rank wrote to sockets (/proc/self/io wchar), median
    "lo_bytes_per_step",    # bytes on the namespace's lo (all ranks), median; "" on loopback
    "predicted_step_ms",    # the cost model's step time for this cell
    "predicted_exposed_ms",
    "peak_rss_mb",          # max over ranks
    "auto_choice",          # compressor="auto": its pick per bucket, ";"-joined
)
WHERE = ("machine", "torch", "pyfast", "python", "timestamp")
COLUMNS = ("cell",) + FLAGS + MEASURED + WHERE

STEP_KEYS = ("step", "loss", "smooth_loss", "step_ms", "exposed_comm_ms", "t_s")
SMOOTH = 10  # steps in the running mean that decides "reached" (one step's loss is noisy)
BASELINE = "bf16"  # the spec every other is judged against (Han et al. 2024: 16-bit, not fp32)


def read_rows(out: str) -> list[dict]:
    """DIR/results.csv's rows (dicts of strings), [] before the first cell finished."""
    path = os.path.join(out, "results.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
