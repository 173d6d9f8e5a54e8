"""pytest-benchmark suite: the tensor-parallel MLP block of `pyfast bench tp`.

One launch of 2 gloo ranks (pyfast.benchmarks.tp.run on plain loopback) runs every variant:
each is checked against the dense block (output, input gradient, weight gradients) before it
is timed, and test_variant fails with the rank's message if it disagrees or cannot run. The
ranks time themselves (the slowest rank's median step is recorded as a property); the dense
block in this process is timed by pytest-benchmark.

PYFAST_BENCH_TP=big|small|tiny picks the block (hidden, mlp, tokens: tp.SHAPES). The default is
small, or tiny and a single step under --benchmark-disable (`make test` runs the suite once so
it cannot rot). docs/benchmarks.md's numbers come from `pyfast bench tp`.
"""
import os

import pytest
import torch

from pyfast.benchmarks import tp


@pytest.fixture(scope="module")
def shape(request):
    default = "tiny" if request.config.getoption("benchmark_disable") else "small"
    return os.environ.get("PYFAST_BENCH_TP", default)


@pytest.fixture(scope="module")
def launch(request, shape):
    quick = request.config.getoption("benchmark_disable")
    res = tp.run(["loopback"], [shape], tp.VARIANTS, repeats=1 if quick else 7,
                 warmup=0 if quick else 2, timeout=300, log=lambda *_: None)
    return {r["variant"]: r for r in res["blocks"][0]["rows"]}


@pytest.mark.parametrize("variant", tp.VARIANTS)
def test_variant(launch, variant, record_property):
    r = launch[variant]
    assert "problem" not in r, r.get("problem")
    assert r["median_s"] > 0
    record_property("step_s_slowest_rank", r["median_s"])


@pytest.mark.parametrize("threads", [1, 2])
def test_dense_block(benchmark, shape, threads):
    hidden, mlp, tokens = tp.SHAPES[shape]
    m = tp.block(hidden, mlp)
    x, gy = tp.inputs(hidden, tokens)
    x.requires_grad_(True)

    def step():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(gy)
        torch.set_num_threads(old)
    benchmark.extra_info.update(threads=threads, hidden=hidden, mlp=mlp, tokens=tokens)
    benchmark(step)
    assert x.grad is not None
