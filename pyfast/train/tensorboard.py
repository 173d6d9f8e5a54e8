"""TensorBoard event files of a run, written from metrics.jsonl's own records (which stay the
source of truth): every numeric field of a step's record becomes a scalar at that step, under
a group named by TAGS, and a generated sample (`--sample-every`) a text summary. Global rank 0
writes them beside metrics.jsonl, in RUN_DIR/tb.

--tensorboard auto (the default) is on when the `tensorboard` package imports (pyfast[tb]),
off otherwise; --tensorboard (on) without it is refused before launch (config.check_watch).
"""
from __future__ import annotations

import importlib.util
import os

# metrics.jsonl key -> TensorBoard tag; a numeric key not listed here (a new metric) still gets
# a scalar, as "other/KEY"
TAGS = {
    "loss": "loss/train", "val_loss": "loss/val",
    "lr": "optim/lr", "grad_norm": "optim/grad_norm", "loss_scale": "optim/loss_scale",
    "skipped": "optim/skipped",
    "tokens_per_s": "perf/tokens_per_s", "step_ms": "time/step_ms",
    "compute_ms": "time/compute_ms", "exposed_comm_ms": "time/exposed_comm_ms",
    "bytes_sent": "comm/bytes_sent", "compress_rel_error": "comm/compress_rel_error",
    "cross_node_bytes": "comm/cross_node_bytes",
    "max_rss_mb": "memory/max_rss_mb",
    "gpu_util": "gpu/util_percent", "gpu_mem_mb": "gpu/mem_mb",
}
SAMPLE_TAG = "sample"


def available() -> bool:
    """Whether `tensorboard` is installed (torch.utils.tensorboard needs it), without importing
    it (a second of imports on a rank that will not write)."""
    return importlib.util.find_spec("tensorboard") is not None


def resolve(mode: str) -> bool:
    """--tensorboard auto|on|off -> whether this run writes event files (on without the
    package: config.check_watch has refused it before launch)."""
    return mode == "on" or (mode == "auto" and available())


def describe(mode: str, out) -> str:
    """The run log's line: whether TensorBoard is on, why, and where the event files go."""
    if resolve(mode):
        why = "--tensorboard" if mode == "on" else "on by default: tensorboard is installed"
        return f"tensorboard: {logdir(out)} ({why}; tensorboard --logdir {logdir(out)})"
    why = "--no-tensorboard" if mode == "off" else \
        "tensorboard is not installed: pip install 'pyfast[tb]'"
    return f"tensorboard: off ({why})"


def logdir(out) -> str:
    return os.path.join(os.fspath(out), "tb")


def tag(key: str) -> str:
    return TAGS.get(key, f"other/{key}")


class TensorBoardLog:
    """SummaryWriter over RUN_DIR/tb. start: the step the run continues after (0: fresh);
    TensorBoard drops the events an earlier run in this directory wrote past it (purge_step),
    as MetricsLog drops its records."""

    def __init__(self, out, start: int):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(logdir(out), purge_step=start + 1)
        # now, not on its writer thread during step 1: the job counts a step's bytes on the
        # wire as the process's write() bytes (/proc/self/io wchar), and the event file's
        # 73-byte header showed up as "sent" by a one-process run
        self.writer.flush()

    def write(self, rec: dict) -> None:
        step = rec["step"]
        for key, value in rec.items():
            if key == "step":
                continue
            if key == SAMPLE_TAG and isinstance(value, str):
                # markdown: a fenced block keeps the sample's spacing and newlines
                self.writer.add_text(SAMPLE_TAG, f"```\n{value}\n```", step)
            elif isinstance(value, (int, float)):  # bool too: skipped steps as 0/1
                self.writer.add_scalar(tag(key), float(value), step)
        self.writer.flush()  # like metrics.jsonl: a killed run keeps every finished step

    def close(self) -> None:
        self.writer.close()
