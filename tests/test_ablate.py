"""`pyfast ablate`: flags checked before any rank starts; small ablations on the teacher task
(seconds each) write a well-formed results.csv, per-step curves and a report; --resume skips
finished cells; a killed rank fails its cell only; links that cannot be emulated are skipped
with the reason; a target never reached reads "not reached"."""
import csv
import json

import pytest

import pyfast.ablate as A
from pyfast.ablate import config as acfg
from pyfast.ablate.schema import COLUMNS, STEP_KEYS
from pyfast.benchmarks import netns

TEACHER = ["--task", "teacher", "--links", "loopback", "--error-feedback", "on"]


@pytest.mark.parametrize("flags,message", [
    (["--specs", "int8,int9"], "--specs: unknown compressor spec 'int9'"),
    (["--task", "gpt-huge"], "--task 'gpt-huge': one of teacher, gpt-tiny, gpt-small"),
    (["--links", "loopback,5parsec"], "--links: link '5parsec' is not 'loopback' or a tc rate"),
    (["--world", "1"], "--world [1]: data parallelism needs at least 2 ranks"),
    (["--world", "3"], "--batch 64 is not divisible by --world 3"),
    (["--error-feedback", "maybe"], "--error-feedback maybe: on and/or off"),
    (["--specs", "int8,int8"], "--specs ['int8', 'int8']: a value appears twice"),
    (["--bucket-mb", "-1"], "--bucket-mb [-1.0]: sizes must be > 0"),
    (["--seeds", "a"], "--seeds 'a': expected a comma-separated list of int"),
    (["--steps", "-1"], "need --steps, --batch >= 1"),
])
def test_bad_flags_fail_before_any_rank_starts(flags, message, tmp_path, capsys):
    assert A.main(["--task", "teacher", "--out", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "x").exists()  # nothing was run or written


def test_toml_config_and_flags_override_it(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text('task = "teacher"\nspecs = ["bf16", "topk:0.01"]\nlinks = "loopback,1gbit"\n'
                 'world = [2, 4]\nsteps = 7\n')
    cfg = acfg.from_args(["--config", str(f), "--steps", "9"])
    assert (cfg.specs, cfg.links, cfg.world, cfg.steps) == (["bf16", "topk:0.01"],
                                                            ["loopback", "1gbit"], [2, 4], 9)
    assert cfg.target_loss == acfg.TASK_DEFAULTS["teacher"]["target_loss"]
    f.write_text('task = "teacher"\nspecz = ["bf16"]\n')
    with pytest.raises(acfg.AblateError, match=r"unknown keys \['specz'\]"):
        acfg.from_args(["--config", str(f)])
    f.write_text('task = "teacher\n')
    with pytest.raises(acfg.AblateError, match="--config"):
        acfg.from_args(["--config", str(f)])


def test_the_matrix_runs_lossless_specs_once_and_names_cells_uniquely():
    cfg = acfg.from_args(["--task", "teacher", "--specs", "none,bf16,int8,auto",
                          "--links", "loopback,1gbit", "--world", "2,4", "--seeds", "0,1"])
    cs = acfg.cells(cfg)
    # none and bf16 are lossless (no error feedback to turn on or off): 1 + 1 + 2 + 2 per
    # (link, world, seed)
    assert len(cs) == 6 * 2 * 2 * 2
    assert {c["error_feedback"] for c in cs if c["spec"] in ("none", "bf16")} == {"n/a"}
    assert len({c["cell"] for c in cs}) == len(cs)
    assert all(set(c["cell"]) <= set("abcdefghijklmnopqrstuvwxyz0123456789_.-") for c in cs)
    links = [c["link"] for c in cs]
    assert links == sorted(links, key=["loopback", "1gbit"].index)  # link-major: one launch each


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        r = csv.DictReader(f)
        assert tuple(r.fieldnames) == COLUMNS
        return list(r)


def test_a_two_cell_ablation_writes_csv_curves_and_report_and_resumes(tmp_path):
    out = tmp_path / "abl"
    base = [*TEACHER, "--specs", "bf16,int8", "--out", str(out)]
    assert A.main(base) == 0
    rows = _rows(out)
    assert [(r["spec"], r["error_feedback"], r["status"]) for r in rows] == \
        [("bf16", "n/a", "done"), ("int8", "on", "done")]
    for r in rows:
        steps = int(r["steps"])
        assert r["reached"] == "yes" and 1 <= int(r["steps_to_target"]) <= steps
        assert 0 < float(r["time_to_target_s"]) <= float(r["train_s"])
        for k in ("final_loss", "val_loss", "step_ms", "compute_ms", "comm_ms", "encode_ms",
                  "decode_ms", "predicted_step_ms", "wire_bytes_per_step",
                  "proc_bytes_per_step", "peak_rss_mb"):
            assert float(r[k]) > 0, (k, r[k])
        assert float(r["final_loss"]) < 0.5  # learned: 1.0 is predicting the mean
        curve = [json.loads(line) for line in open(out / "cells" / f"{r['cell']}.jsonl")]
        assert [c["step"] for c in curve] == list(range(1, steps + 1))
        assert set(curve[0]) == set(STEP_KEYS)
        assert curve[-1]["t_s"] == pytest.approx(float(r["train_s"]), rel=1e-4)
    # int8 puts about a quarter of fp32's bytes on the wire, bf16 half: 0.55x, +-10% headers
    wire = [float(r["wire_bytes_per_step"]) for r in rows]
    assert 0.45 < wire[1] / wire[0] < 0.65, wire
    report = (out / "report.md").read_text()
    assert "int8" in report and "bf16" in report
    # a fresh run into the same directory would mix two ablations
    assert A.main(base) == 2
    with pytest.raises(acfg.AblateError, match="other settings"):
        A.run(acfg.from_args([*base, "--steps", "5", "--resume"]))
    # --resume runs only the new cell; the finished rows are kept as they were
    assert A.main([*TEACHER, "--specs", "bf16,int8,int4", "--out", str(out), "--resume"]) == 0
    again = _rows(out)
    assert again[:2] == rows and [r["spec"] for r in again] == ["bf16", "int8", "int4"]


def test_a_killed_rank_fails_its_cell_and_the_rest_run(tmp_path, monkeypatch):
    out = tmp_path / "abl"
    cfg = acfg.from_args([*TEACHER, "--specs", "int8,int4", "--out", str(out)])
    monkeypatch.setenv("PYFAST_ABLATE_FAULT", f"{acfg.cells(cfg)[0]['cell']}@3")
    A.run(cfg)
    rows = _rows(out)
    assert [(r["spec"], r["status"]) for r in rows] == [("int8", "failed"), ("int4", "done")]
    assert "exit codes" in rows[0]["reason"] and "-9" in rows[0]["reason"], rows[0]["reason"]
    # --resume tries the failed cell again and keeps the finished one as it was
    monkeypatch.delenv("PYFAST_ABLATE_FAULT")
    A.run(acfg.from_args([*TEACHER, "--specs", "int8,int4", "--out", str(out), "--resume"]))
    again = _rows(out)
    assert again[0] == rows[1] and [(r["spec"], r["status"]) for r in again] == \
        [("int4", "done"), ("int8", "done")]


def test_unavailable_links_are_skipped_with_the_reason_and_never_reached_says_so(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(netns, "unavailable", lambda: "emulated links need root: uid 1000")
    out = tmp_path / "abl"
    assert A.main(["--task", "teacher", "--links", "loopback,1gbit", "--specs", "bf16",
                   "--target-loss", "1e-9", "--steps", "12", "--out", str(out)]) == 0
    assert "link 1gbit: emulated links need root: uid 1000" in capsys.readouterr().out
    rows = _rows(out)
    assert [(r["link"], r["status"]) for r in rows] == [("loopback", "done"), ("1gbit", "skipped")]
    assert rows[1]["reason"] == "emulated links need root: uid 1000"
    assert rows[0]["reached"] == "no" and rows[0]["time_to_target_s"] == ""
    assert "not reached" in (out / "report.md").read_text()


def test_gpt_cells_run_the_main_job_and_error_feedback_reaches_it(tmp_path):
    out = tmp_path / "abl"
    assert A.main(["--task", "gpt-tiny", "--links", "loopback", "--specs", "int4",
                   "--steps", "4", "--seq", "32", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [(r["error_feedback"], r["status"]) for r in rows] == [("on", "done"), ("off", "done")]
    # the same data and initialisation: only the error-feedback memory tells the runs apart
    assert rows[0]["final_loss"] != rows[1]["final_loss"]
