"""What one rank (global rank 0) shows and keeps of a run: DIR/metrics.jsonl (one JSON object
per optimizer step, flushed as written, so a killed run keeps every finished step), a rich
progress bar (a plain line every ~10% of the steps when stdout is not a terminal), and at the
end DIR/curves.png (when matplotlib is installed) and a summary table."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from pyfast._io import atomic_path, atomic_write_text


def read(path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsLog:
    """Append-only JSONL. resume_step: keep the records up to that step (a resumed run
    continues after its checkpoint; what a killed run logged past it is dropped), None: a
    fresh log."""

    def __init__(self, out, resume_step: int | None):
        self.path = Path(out) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read(self.path) if r["step"] <= resume_step] \
            if resume_step is not None else []
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.f = open(self.path, "a")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()  # in the kernel's page cache: survives the process being killed

    def close(self) -> None:
        self.f.close()


class Progress:
    def __init__(self, total: int, start: int):
        from rich.console import Console
        self.console = Console()
        self.total, self.live = total, self.console.is_terminal
        self.every = max(1, total // 10)
        self.bar = None
        if self.live:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar,
                                       TextColumn, TimeRemainingColumn)
            self.bar = Bar(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                           TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                           console=self.console, auto_refresh=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, rec: dict) -> None:
        info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s"
        if "val_loss" in rec:
            info += f"  val {rec['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], info=info)
            self.bar.refresh()  # manual: no refresh thread writing during a timed step
        elif rec["step"] % self.every == 0 or rec["step"] == self.total:
            self.console.print(f"step {rec['step']}/{self.total}  {info}  "
                               f"{rec['step_ms']:.0f} ms/step")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot(records: list[dict], path) -> str:
    """Loss and validation loss vs step, tokens/s vs step (matplotlib, written atomically).
    Returns the line to tell the user: where the plot is, or that matplotlib (optional:
    pyfast[plot]) is not installed and there is none."""
    try:
        import matplotlib
    except ImportError:
        return "plot: none (matplotlib is not installed: pip install 'pyfast[plot]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in records]
    a.plot(steps, [r["loss"] for r in records], label="train loss")
    val = [r for r in records if "val_loss" in r]
    if val:
        a.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    a.set_xlabel("step")
    a.set_ylabel("loss (nats/token)")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, [r["tokens_per_s"] for r in records])
    b.set_xlabel("step")
    b.set_ylabel("tokens/s")
    b.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return f"plot: {path}"


def sent_row(records: list[dict], med) -> tuple[str, str]:
    """The bytes row: with DiLoCo replicas (--replicas R > 1) a step's bytes_sent are replica
    0's ranks only and the whole world's arrive as replicas_bytes_sent at each meeting (train/
    outer.py), so the row is their total over the steps; without them, the median step."""
    met = [r["replicas_bytes_sent"] for r in records if "replicas_bytes_sent" in r]
    if met:
        return ("MB sent per step, all ranks (mean over the run)",
                f"{sum(met) / len(records) / 1e6:.2f}")
    return ("MB sent per step, all ranks (median)", f"{med('bytes_sent') / 1e6:.2f}")


def summary(records: list[dict], title: str):
    """A rich Table of the run (medians skip the first step: warm-up)."""
    from rich.table import Table
    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    timed = records[1:] or records
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    val = [r for r in records if "val_loss" in r]
    rows = [("steps", f"{records[0]['step']}..{records[-1]['step']}"),
            ("loss first -> last", f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"),
            ("val loss (last)", f"{val[-1]['val_loss']:.4f}" if val else "-"),
            ("tokens/s (median)", f"{med('tokens_per_s'):,.0f}"),
            ("step ms (median)", f"{med('step_ms'):.1f}"),
            ("exposed comm ms (median)", f"{med('exposed_comm_ms'):.1f}"),
            sent_row(records, med),
            *([("of which across the shard groups (nodes)", f"{med('cross_node_bytes') / 1e6:.2f}")]
              if all("cross_node_bytes" in r for r in timed) else []),
            ("peak RSS MB (max rank)", f"{max(r.get('max_rss_mb', 0) for r in records):.0f}"),
            # --elastic: each start that changed the mesh (pyfast.train.elastic.describe)
            *(("elastic", r["elastic"]) for r in records if "elastic" in r)]
    ft = [r for r in records if "committed" in r]  # --ft (pyfast.train.ft_step)
    if ft:
        parts = [r["participants"] for r in ft]
        rows += [("steps not committed (--ft)", str(sum(not r["committed"] for r in ft))),
                 ("replica groups taking part (min..max)", f"{min(parts)}..{max(parts)}"),
                 ("quorum ms (median)", f"{statistics.median(r['quorum_ms'] for r in ft):.1f}")]
    for k, v in rows:
        t.add_row(k, v)
    return t
