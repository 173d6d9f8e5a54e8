"""Where a step goes: pyfast._ranges' named ranges, `pyfast train --profile START:END` (a trace
per rank, the per-step split) and its bad inputs.

The split's parts add up to the step by construction (each instant goes to one part, the rest
is "other"): checked to 1e-9 s, float rounding of microsecond sums. The ranges themselves are
checked by name in the traces the job writes; the split's arithmetic on a trace whose answer
is worked out by hand below.
"""
import glob
import json
import os
import threading

import pytest
import torch

from pyfast._ranges import ranged, span
from pyfast.train import profile_split as S
from pyfast.train.config import ConfigError, TrainConfig, check

PROFILED = {  # name: (nproc, flags); BASE of test_train: gpt-tiny, 3 steps, batch 8, seq 32
    # test_train's dp2-int8 run (shared when it ran in this session), profiled: same losses
    "dp2-int8": (2, ["--dp", "2", "--compress", "int8", "--steps", "4"]),
    "dp2-int8-profile": (2, ["--dp", "2", "--compress", "int8", "--steps", "4",
                             "--profile", "2:4"]),
    "pp2-profile": (2, ["--pp", "2", "--schedule", "1f1b", "--profile", "2:4"]),
}


def test_a_range_is_a_shared_noop_outside_a_profiler_and_named_inside_one():
    from torch.profiler import profile

    from pyfast.train.profile import _all_threads
    assert span("pyfast.comm.x") is span("pyfast.dp.y")  # nothing made per call

    @ranged("pyfast.codec.test")
    def f(x):
        return x + 1
    assert f(1) == 2 and f.__name__ == "f"

    def worker():  # a thread of its own, as the FIFO communication worker
        with span("pyfast.comm.worker"):
            torch.ones(3).sum()
    with profile(experimental_config=_all_threads()) as p:
        with span("pyfast.comm.main"):
            assert f(torch.ones(2)).sum() == 4
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    names = [e.name for e in p.events()]
    assert {"pyfast.comm.main", "pyfast.codec.test", "pyfast.comm.worker"} <= set(names)


def test_nvtx_asked_for_without_cuda_turns_itself_off(monkeypatch):
    """PYFAST_NVTX=1 (or Nsight's NVTX_INJECTION64_PATH) on a machine without CUDA: the first
    range finds no CUDA and NVTX is off from then on (with CUDA it pushes nvtx ranges: not run
    here)."""
    from pyfast import _ranges
    monkeypatch.setattr(_ranges, "_NVTX_ASKED", True)
    monkeypatch.setattr(_ranges, "_nvtx", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with span("pyfast.comm.x"):
        pass
    assert not _ranges._NVTX_ASKED and not _ranges.active()
    assert span("pyfast.comm.y") is span("pyfast.comm.z")


def _x(name, ts, dur, tid=1, cat="user_annotation"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 7, "cat": cat}


def test_the_split_of_a_hand_made_trace():
    """Step [0, 100) us: data [0, 10); an operator [5, 90); comm [20, 60) holding codec
    [30, 40); gloo's annotation of a receive posted at 0 and done at 100 (in flight, not
    waited on: no part); on another thread comm [50, 120) (overlapped: background, clipped to
    the step). Precedence data > codec > bubble > comm > compute: data 10, codec 10, comm
    40 - 10 = 30, compute [10, 20) + [60, 90) = 40, other 100 - 90 = 10."""
    trace = {"traceEvents": [
        _x("pyfast.train.step#7", 0, 100), _x("pyfast.data.next", 0, 10),
        _x("aten::mm", 5, 85, cat="cpu_op"), _x("pyfast.dp.wait", 20, 40),
        _x("pyfast::quantize", 30, 10, cat="cpu_op"),
        _x("pyfast.comm.all_reduce", 50, 70, tid=2), _x("ProfilerStep#7", -5, 110),
        _x("gloo:recv", 0, 100)]}
    (s,) = S.split(trace)
    want = {"data": 10, "codec": 10, "bubble": 0, "comm": 30, "compute": 40, "other": 10}
    assert s["step"] == 7 and s["step_s"] == pytest.approx(100e-6)
    for p, us in want.items():
        assert s[f"{p}_s"] == pytest.approx(us * 1e-6, abs=1e-12), p
        assert s[f"{p}_pct"] == pytest.approx(us)
    assert s["background"]["comm_s"] == pytest.approx(50e-6)
    assert S.subtract([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    from test_train import shared_runs
    return shared_runs(tmp_path_factory, PROFILED)


def _traces(out):
    return {r: glob.glob(os.path.join(out, "profile", f"rank{r}.*.pt.trace.json"))
            for r in (0, 1)}


def _names(path):
    with open(path) as f:
        return {e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"}


def _split(out):
    with open(os.path.join(out, "profile", "split.json")) as f:
        return json.load(f)


def _sums_to_the_step(split, steps):
    assert [r["rank"] for r in split["ranks"]] == [0, 1]
    for r in split["ranks"]:
        assert [s["step"] for s in r["steps"]] == steps
        for s in r["steps"]:
            parts = [s[f"{p}_s"] for p in S.PARTS]
            assert min(parts) >= 0 and abs(sum(parts) - s["step_s"]) < 1e-9, s
            assert s["comm_s"] > 0  # at least the job's all-reduce of loss and norm


@pytest.mark.dist
def test_dp2_int8_traces_name_the_collectives_codec_and_wait(profiled):
    from test_train import losses
    out = profiled["dp2-int8-profile"]
    assert losses(out) == losses(profiled["dp2-int8"])  # the profiler changes no value
    for r, found in _traces(out).items():
        assert len(found) == 1, found  # one trace per rank, tensorboard_trace_handler's name
        names = _names(found[0])
        assert {"pyfast.dp.wait", "pyfast.dp.launch", "pyfast.data.next"} <= names
        assert any(n.startswith("pyfast.comm.") for n in names)
        assert any(n.startswith("pyfast.codec.") for n in names)
        steps = sorted(n for n in names if n.startswith(("pyfast.train.step#", "ProfilerStep#")))
        assert steps == ["ProfilerStep#2", "ProfilerStep#3", "pyfast.train.step#2",
                         "pyfast.train.step#3"]  # exactly the window 2..3
    split = _split(out)
    assert split["window"] == [2, 4] and split["parts"] == list(S.PARTS)
    _sums_to_the_step(split, [2, 3])
    for r in split["ranks"]:  # int8 is encoded on the native engine's thread: overlapped
        assert sum(s["background"]["codec_s"] + s["codec_s"] for s in r["steps"]) > 0


@pytest.mark.dist
def test_pp2_trace_has_the_pipeline_actions_and_a_bubble(profiled):
    out = profiled["pp2-profile"]
    for r, found in _traces(out).items():
        names = _names(found[0])
        want = {"pyfast.pipe.F", "pyfast.pipe.B", "pyfast.pipe.send", "pyfast.pipe.wait"}
        assert want <= names, want - names
    split = _split(out)
    _sums_to_the_step(split, [2, 3])
    for r in split["ranks"]:  # 1f1b at 2 stages: each stage waits for the other
        assert r["mean"]["bubble_s"] > 0 and r["mean"]["bubble_pct"] > 0, r["mean"]


def test_bad_profile_windows_are_refused_naming_them():
    def refused(spec, steps=10):
        with pytest.raises(ConfigError) as e:
            check(TrainConfig(model="gpt-tiny", seq=32, steps=steps, profile=spec), 1)
        return str(e.value)

    assert "START:END, two integers" in refused("3")
    assert "START:END, two integers" in refused("a:5")
    assert "START:END, two integers" in refused("1:2:3")
    assert "START 4 must be < END 4" in refused("4:4")
    assert "START must be >= 1" in refused("0:2")
    msg = refused("5:13")
    assert "END 13 is beyond --steps 10" in msg and "at most 11" in msg
    check(TrainConfig(model="gpt-tiny", seq=32, steps=10, profile="10:11"), 1)  # the last step
    from pyfast.train.config import from_args, parser
    from pyfast.train.launch import worker_args
    cfg = from_args(parser().parse_args(["--steps", "5", "--profile", "2:4"]))
    assert from_args(parser().parse_args(worker_args(cfg))) == cfg  # what torchrun's ranks get
    from pyfast.train.dryrun import check_dry
    with pytest.raises(ConfigError, match="--dry-run with --profile 1:2"):
        check_dry(TrainConfig(model="gpt-tiny", seq=32, profile="1:2"), 1, [0], None)
