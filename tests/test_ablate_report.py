"""pyfast.ablate.report on a hand-made results.csv (no ranks): ratios to bf16 computed here
independently, the best fixed choice marked, "not reached" where the target was missed,
skipped/diverged rows shown with their reason, auto judged with error feedback on, the PNGs."""
import csv
import json

import pytest

from pyfast.ablate import report
from pyfast.ablate.schema import COLUMNS


def _row(link, spec, ef, tt, steps=None, status="done", reason="", auto="", step=40.0,
         pred=42.0, loss=2.3):
    r = {k: "" for k in COLUMNS}
    r.update(cell=f"{spec}-{ef}-{link}".replace(":", "-").replace("/", "-"), task="gpt-tiny", spec=spec,
             error_feedback=ef, bucket_mb="0", link=link, world="2", seed="0", steps="200",
             target_loss="2.35", status=status, reason=reason, auto_choice=auto,
             machine="test machine", torch="2.13", pyfast="0.1", python="3.11",
             timestamp="2026-11-24T00:00:00")
    if status == "done":
        r.update(final_loss=str(loss), val_loss=str(loss - 0.1), step_ms=str(step),
                 compute_ms="30", encode_ms="0.2", decode_ms="0.1", comm_ms="3",
                 exposed_comm_ms="5", wire_bytes_per_step="265728", proc_bytes_per_step="283796",
                 predicted_step_ms=str(pred), predicted_exposed_ms="2", peak_rss_mb="500",
                 train_s="8", reached="yes" if tt else "no",
                 steps_to_target=str(steps or 100) if tt else "",
                 time_to_target_s=str(tt) if tt else "")
    return r


@pytest.fixture
def abl(tmp_path):
    rows = [
        _row("loopback", "bf16", "n/a", 4.0), _row("loopback", "int8", "on", 4.2),
        _row("loopback", "auto", "on", 4.1, auto="fp16"), _row("loopback", "auto", "off", 3.0,
                                                               auto="int8"),
        _row("loopback", "sign", "on", None, loss=2.6),
        _row("loopback", "topk:0.01", "on", None, status="diverged", reason="step 7: loss nan"),
        _row("100mbit", "bf16", "n/a", 8.0, pred=80.0), _row("100mbit", "int8", "on", 5.0),
        _row("100mbit", "int4", "on", 4.0, steps=115), _row("100mbit", "auto", "on", 4.1,
                                                             auto="int4"),
        _row("1gbit", "bf16", "n/a", None, status="skipped", reason="needs root: uid 1000"),
    ]
    (tmp_path / "cells").mkdir()
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        if r["status"] == "done":
            with open(tmp_path / "cells" / f"{r['cell']}.jsonl", "w") as f:
                for s in range(1, 4):
                    f.write(json.dumps({"step": s, "loss": 3.0 - s / 10, "smooth_loss": 3.0 - s / 10,
                                        "step_ms": 40.0, "exposed_comm_ms": 5.0,
                                        "t_s": s * 0.04}) + "\n")
    return tmp_path


def _table(md: str, title: str) -> dict:
    """{config: cells} of the markdown table under `## title`."""
    part = md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln.strip("|").split("|") for ln in part.splitlines() if ln.startswith("| ")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows[1:]}


def test_report_tables_ratios_best_and_not_reached(abl):
    md = open(report.write(str(abl))).read()
    lo = _table(md, "loopback, 2 ranks")
    assert lo["int8 EF on"][2] == f"{4.0 / 4.2:.2f}x"  # speedup vs bf16 = bf16 time / its time
    assert "bf16 **best**" in lo  # auto is not a fixed choice, even when sooner
    assert lo["sign EF on"][:3] == ["not reached", "not reached", "not reached"]
    assert lo["sign EF on"][4] == f"{2.6 - 2.3:+.4f}"  # final loss vs bf16's
    assert lo["topk:0.01 EF on"][0] == "diverged: step 7: loss nan"
    slow = _table(md, "100mbit, 2 ranks")
    assert "int4 EF on **best**" in slow and slow["int4 EF on **best**"][2] == "2.00x"
    assert slow["bf16"][15] == f"{80.0 / 40.0:.2f}"  # predicted / measured
    assert "Skipped: needs root: uid 1000" in md


def test_headline_and_targets(abl):
    report.write(str(abl))
    head = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in report.headline(str(abl)).splitlines()[2:]}
    # auto with error feedback on (DataParallel's default): 4.1 s, not the other's 3.0 s
    assert head["loopback"][4] == "auto EF on: fp16" and head["loopback"][5] == f"{4.1 / 4.0:.3f}"
    assert head["100mbit"][2:5] == ["int4 EF on", "2.00x", "auto EF on: int4"]
    assert head["100mbit"][5] == f"{4.1 / 4.0:.3f}" and head["100mbit"][6] == f"{8.0 / 4.1:.2f}x"
    assert head["100mbit"][7] == "3 of 4, 100%"  # bf16 predicted 80 ms for 40: off by 100%
    md = (abl / "report.md").read_text()
    assert "100mbit, W=2: auto (int4) 1.025x the best fixed time, 0.512x bf16's: met" in md
    assert "loopback, W=2: auto (fp16) 1.025x the best fixed time, 1.025x bf16's: met" in md
    for png in ("loss_vs_step_loopback.png", "loss_vs_time_100mbit.png",
                "speedup_vs_bandwidth.png", "auto_vs_best.png"):
        assert (abl / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"![{png}]({png})" in md
