"""`pyfast bench gpu` (issue 37's script for a lent GPU), checked on the CPU at --small sizes:
every part runs in its own child and lands in the result, a failing or slow part is reported
and the others still run, the fractions and targets are computed as stated, bad options are
refused. The GPU figures themselves need a lent GPU (tools/gpu_check.sh)."""
from __future__ import annotations

import json
import math

import pytest

from pyfast.benchmarks import gpu, gpu_parts


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "small"
    assert gpu.main(["--device", "cpu", "--small", "--parts", "roof,quantize,topk,overlap",
                     "--out", str(out)]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".txt").read_text()


def test_every_part_asked_for_runs_and_is_recorded(small):
    res, txt = small
    assert set(res["parts"]) == {"roof", "quantize", "topk", "overlap"}
    assert not any("error" in p for p in res["parts"].values()), res["parts"]
    assert res["parts"]["roof"]["GBps"] > 0 and res["versions"]["torch"]
    kinds = {(r["kind"], r["backend"]) for r in res["parts"]["quantize"]["rows"]}
    for kind in ("int8", "fp8", "int4", "sign", "ternary", "e3m0"):
        assert (kind, "torch") in kinds
    assert {("int8", "cpp"), ("ternary", "cpp")} <= kinds  # the C++ kernels where built
    for r in res["parts"]["quantize"]["rows"]:
        assert r["compress_s"] > 0 and r["decompress_s"] > 0 and r["wire_ratio"] > 1
        # both directions' bytes over both times: between the two one-way rates
        lo, hi = sorted((r["compress_GBps"], r["decompress_GBps"]))
        assert lo <= r["GBps"] * (1 + 1e-9) and r["GBps"] <= hi * (1 + 1e-9)
        assert math.isclose(r["roof"], r["GBps"] / res["parts"]["roof"]["GBps"])
    tk = res["parts"]["topk"]
    assert tk["k"] == round(0.01 * tk["numel"]) and tk["torch"]
    for r in tk["rows"]:  # reads: the time over one read of the input at half the copy rate
        assert math.isclose(r["reads"], r["seconds"] * res["parts"]["roof"]["GBps"] * 1e9 / 2
                            / (4 * tk["numel"]))
    o = res["parts"]["overlap"]
    assert o["matmul_s"] > 0 and o["allreduce_s"] > 0
    assert math.isclose(o["compute_slowdown"], o["matmul_with_allreduce_s"] / o["matmul_s"] - 1)
    # on the CPU the targets are listed, never judged
    assert res["targets"] and all(t["met"] is None for t in res["targets"])
    assert {r["impl"] for r in tk["rows"]} >= {"torch.topk(|x|)", "pyfast topk (cpp)",
                                               "pyfast topk_exact (torch)"}
    assert "not a target run" in txt and "exact, reads of the input" in txt


def test_a_failing_or_slow_part_is_reported_and_the_rest_still_run(monkeypatch):
    # a CUDA device on this CPU machine: the part's child raises; the error names it
    assert "error" in gpu.run_part("roof", "cuda", True)
    monkeypatch.setattr(gpu, "SMALL_LIMIT", 0.01)
    res = gpu.run("cpu", ("roof", "topk"), small=True, log=lambda *_: None)
    assert all(p == {"error": "timed out after 0.01 s"} for p in res["parts"].values())
    missed = [t for t in res["targets"] if t["target"].startswith("part ")]
    assert [t["target"] for t in missed] == ["part roof", "part topk"]


def test_targets_on_a_gpu_result():
    res = {"small": False, "device": "cuda", "datasheet_GBps": 4800.0, "parts": {
        "roof": {"GBps": 4000.0},
        "quantize": {"rows": [
            {"kind": "int8", "backend": "triton", "compress_GBps": 3500.0,
             "decompress_GBps": 3300.0, "GBps": 3400.0},
            {"kind": "int4", "backend": "cpp", "compress_GBps": 3000.0,
             "decompress_GBps": 3300.0, "GBps": 3150.0},
            {"kind": "e3m0", "backend": "torch", "compress_GBps": 100.0,
             "decompress_GBps": 100.0, "GBps": 100.0}]},
        "topk": {"numel": 1 << 26, "rows": [
            {"impl": "pyfast topk (cpp)", "exact": False, "seconds": 1.2 * (4 << 26) / 2000e9},
            {"impl": "pyfast topk_exact (triton)", "exact": True,
             "seconds": 2.5 * (4 << 26) / 2000e9}]},
        "linear": {"rows": [{"M": 8192, "K": 1024, "N": 16384, "vs_gemm": 0.95,
                             "vs_separate": 1.05}]},
        "attention": {"rows": [{"S": 8192, "D": 128, "pyfast_TFLOPS": 470.0}]},
        "overlap": {"compute_slowdown": 0.12}}}
    gpu.annotate(res)
    q = res["parts"]["quantize"]["rows"]
    assert math.isclose(q[0]["roof"], 0.85) and math.isclose(q[0]["sheet"], 3400 / 4800)
    got = {t["target"]: t["met"] for t in gpu.targets(res)}
    assert got["int8 (triton) compress + decompress, of the copy roof"] is True   # 85% >= 85%
    assert got["int4 (cpp) compress + decompress, of the copy roof"] is False     # 79% < 80%
    assert not any(k.startswith("e3m0") for k in got)  # no target set for the reference
    assert got["pyfast topk (cpp): threshold mode, reads of the input"] is True  # 1.2 reads
    assert got["pyfast topk_exact (triton): exact, reads of the input"] is False  # 2.5 reads
    assert got["linear_act 8192x1024x16384 vs cuBLAS GEMM only"] is True
    assert got["linear_act 8192x1024x16384 vs GEMM + separate GELU"] is False
    assert got["block attention fwd S=8192 D=128"] is True
    assert got["matmuls slowed by the engine's all-reduces beside them"] is False


def test_datasheet_bandwidth_by_device_name():
    assert gpu.datasheet_bps("NVIDIA H200") == 4.8e12
    assert gpu.datasheet_bps("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu.datasheet_bps("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert gpu.datasheet_bps("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpu.datasheet_bps("NVIDIA L4") is None


@pytest.mark.parametrize("argv, msg", [
    (["--device", "cpu"], "needs --small"),
    (["--device", "cpu", "--small", "--parts", "roof,warp"], "unknown warp"),
])
def test_bad_options_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit):
        gpu.main(argv)
    assert msg in capsys.readouterr().err


def test_timed_is_the_median_of_the_repeats_after_a_warm_call(monkeypatch):
    import types

    import torch
    ticks = iter([0, 5, 10, 11, 20, 23, 30, 32, 40, 44])  # calls of 5, 1, 3, 2, 4 s
    monkeypatch.setattr(gpu_parts, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(gpu_parts, "_l2_bytes", lambda d: 1 << 12)
    calls = []
    assert gpu_parts.timed(lambda: calls.append(1), torch.device("cpu"), repeats=5) == 3
    assert len(calls) == 6
