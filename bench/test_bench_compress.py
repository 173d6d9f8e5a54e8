"""pytest-benchmark suite: compress + decompress per compressor and backend, decompress into an
existing tensor vs a new one, with the memory roof (a copy) and torch.topk as the side-by-side
baselines. `make bench` records JSON;
`make test` runs it once with --benchmark-disable so it cannot rot. docs/benchmarks.md's table comes
from `pyfast bench compress --out bench/results/compress` (same measurements, one run)."""
import pytest
import torch

import pyfast.compress as C
from conftest import NUMEL
from pyfast import perf
from pyfast.benchmarks.compress import KERNEL_SPECS, SPECS, gradient
from pyfast.ops import status
from pyfast.ops import topk


@pytest.fixture(scope="module")
def x():
    return gradient(NUMEL)


def test_copy_roof(benchmark, x):
    y = torch.empty_like(x)
    benchmark.extra_info["bytes"] = 2 * x.numel() * 4
    benchmark(y.copy_, x)
    assert torch.equal(y, x)


def test_torch_topk(benchmark, x):
    k = topk.target(x.numel(), 0.01)[0]
    v, _ = benchmark(lambda: torch.topk(x.view(-1).abs(), k))
    assert v.numel() == k


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("spec", SPECS)
def test_compress_round_trip(benchmark, x, spec, backend):
    if backend != "torch" and spec not in KERNEL_SPECS:
        pytest.skip(f"{spec} is torch ops only")
    ok, why = status(backend, x.device)
    if not ok:
        pytest.skip(why)
    c = C.get(spec)
    with perf.backend(backend):
        p = c.compress(x, "g")
        first = c.decompress(p)  # random-k and PowerSGD change state per call: compare call 1
        benchmark.extra_info.update(spec=spec, backend=backend, wire_bytes=p.nbytes,
                                    moved_bytes=2 * x.numel() * 4 + 2 * p.nbytes)
        y = benchmark(lambda: c.decompress(c.compress(x, "g")))
    with perf.backend("torch"):  # the reference: what the backend under test must reproduce
        ref = C.get(spec).decompress(C.get(spec).compress(x, "g"))
    torch.testing.assert_close(first, ref, rtol=1e-6, atol=1e-6)
    assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("into", [False, True], ids=["allocate", "into"])
@pytest.mark.parametrize("spec", SPECS)
def test_decompress_into(benchmark, x, spec, into):
    """decompress(p) (fresh pages each call) vs decompress(p, out=buf) (existing pages)."""
    c = C.get(spec)
    p = c.compress(x, "g")
    out = torch.empty_like(x)
    benchmark.extra_info.update(spec=spec, into=into)
    y = benchmark(lambda: c.decompress(p, out=out) if into else c.decompress(p))
    assert torch.equal(y, c.decompress(p))  # into a buffer or a new tensor: the same values
