"""pytest-benchmark suite: compressed all-reduce on 2 gloo ranks over plain loopback, with the
plain gloo all-reduce ("none") as the side-by-side baseline. This process is rank 0 (what
pytest-benchmark times is its call); rank 1 is a subprocess that mirrors every call. Emulated
slow links need root: they run through `pyfast bench allreduce --link 1gbit` (same code), and
test_emulated_link checks that it works here or skips saying why.
"""
import json

import pytest
import torch
import torch.distributed as dist

import pyfast.comm
from conftest import NUMEL
from pyfast.benchmarks import allreduce, netns
from pyfast.benchmarks.compress import gradient

SPECS = ["none", "fp16", "int8", "topk:0.01", "powersgd:4"]
TIMEOUT = 120  # seconds: a lost peer fails the suite instead of hanging it


@pytest.fixture(scope="module")
def rank0():
    """This process is rank 0; rank 1 (allreduce._mirror) repeats every call it is told to."""
    job = json.dumps({"numel": NUMEL, "pg_timeout": TIMEOUT})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per rank, like the peer
    try:
        with netns.ranks(["-c", "from pyfast.benchmarks.allreduce import _mirror; _mirror()"], 2,
                         timeout=TIMEOUT, env={"PYFAST_ALLREDUCE": job}, only=[1]) as peer:
            peer.init_process_group(0, TIMEOUT)
            yield gradient(NUMEL, seed=0), gradient(NUMEL, seed=1)
            dist.broadcast_object_list([None], src=0)
            peer.wait()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("spec", SPECS)
def test_allreduce_loopback_2_ranks(benchmark, rank0, spec):
    x, x1 = rank0
    t = torch.empty_like(x)

    def setup():  # not timed: tell the peer, fresh input, both ranks leave a barrier together
        dist.broadcast_object_list([spec], src=0)
        t.copy_(x)
        dist.barrier()

    payload = pyfast.compress.get(spec).compress(x, "probe").nbytes
    algo = pyfast.comm.choose(pyfast.compress.get(spec), x.numel(), 2)
    benchmark.extra_info.update(spec=spec, algorithm=algo, payload_bytes=payload,
                                wire_bytes=allreduce.wire_bytes(algo, 2, [payload]))
    benchmark.pedantic(lambda: pyfast.comm.all_reduce(t, spec, name="g"), setup=setup,
                       rounds=5, warmup_rounds=1)
    exact = x + x1  # two fp32 addends in a fixed order
    if spec == "none":
        assert torch.equal(t, exact)
    elif spec != "powersgd:4":  # W=2 gathers: each rank's round trip, summed in rank order
        ref = sum(pyfast.compress.get(spec).decompress(pyfast.compress.get(spec).compress(v, "g"))
                  for v in (x, x1))
        torch.testing.assert_close(t, ref, rtol=1e-6, atol=1e-6)
    bound = {"none": 0, "fp16": 1e-3, "int8": 0.02, "topk:0.01": 0.95, "powersgd:4": 1.0}[spec]
    assert (t - exact).norm() <= bound * exact.norm(), spec  # the compressor's own error


def test_emulated_link(tmp_path):
    """`pyfast bench allreduce` on a 1gbit link: runs here, or skips with the reason."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    # 4 MB: 8 MB on the wire, 67 ms of link time at W=2, whatever PYFAST_BENCH_NUMEL says. At
    # make test's 64K elements (512 KB on the wire) the bounds below were too tight for a
    # loaded machine: the time bound was vacuous and the packets' headers and barriers, 4-13 KB
    # a call measured under load (more, smaller packets), nearly filled the 14.5 KB allowed
    numel = 1 << 20
    out = tmp_path / "ar"
    rc = allreduce.main(["--world", "2", "--link", "1gbit", "--numel", str(numel),
                         "--specs", "none,int8", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    rows = json.loads((tmp_path / "ar.json").read_text())["rows"]
    if "skipped" in rows[0]:
        pytest.skip(rows[0]["skipped"])
    for r in rows:
        # the namespace's lo saw what the model says gloo sends (headers, barriers: < 2%)
        assert r["wire_bytes"] <= r["link_bytes"] < 1.02 * r["wire_bytes"] + 4096, r
        # tbf is real, whatever the load: a call's time is the slowest rank's, and the rank
        # that starts first cannot finish before its share of the traffic (wire_bytes / W, all
        # sent after it started) passed the shared bucket: 512 KB free, then 1 Gbit/s. Load
        # only adds time, but it skews the ranks' starts, and the old bound on all of
        # wire_bytes assumed none (this test failed once under load; which check, unrecorded)
        assert r["median_s"] >= (r["wire_bytes"] / 2 - 512 * 1024) * 8 / 1e9, r
    assert "int8" in (tmp_path / "ar.txt").read_text()


def test_unavailable_link_is_a_skip_row(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    res = allreduce.run(worlds=(2,), links=("1gbit",), numel=1024, specs=["none"], repeats=1)
    assert res["rows"] == [{"world": 2, "link": "1gbit", "skipped": netns.unavailable()}]
    assert res["rows"][0]["skipped"].startswith("emulated links need root and iproute2")


def test_summary_holds_each_spec_to_its_floor_bar():
    """int8 within 25% of its link floor (issue 3), top-k within 1.5x (issue 25's bar): a row at
    1.3x its floor meets top-k's and misses int8's."""
    def row(spec, median):
        return {"world": 2, "link": "1gbit", "spec": spec, "median_s": median, "floor_s": 1.0}
    res = {"rows": [row("none", 40.0), row("fp16", 20.0), row("int8", 1.3), row("topk:0.01", 1.3)]}
    lines = allreduce.targets(res)
    assert "met    W=2 topk:0.01: 1.30x its floor (target <= 1.5x)" in lines
    assert "MISSED W=2 int8: 1.30x its floor (target <= 1.25x)" in lines
    assert "met    W=2 topk:0.01 vs none: 30.77x (target 15x)" in lines
