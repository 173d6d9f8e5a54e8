"""pytest-benchmark suite: one pipeline training step per provider on 2 gloo ranks (pyfast's
schedules, torch.distributed.pipelining's), and one process with 1 and 2 threads doing the same
step whole or in the same 8 micro-batches. The timed call includes handing the step to the rank
processes (~0.2 ms of queues); extra_info has the slowest rank's own step time.

PYFAST_BENCH_PIPELINE=large|tiny|small picks the model (8 x Linear(w)+ReLU; large: w=1024,
batch 256; tiny: 256, 32; small: 64, 16). The default is large, or small under
--benchmark-disable (`make test` runs the suite once so it cannot rot). docs/benchmarks.md's numbers
come from `pyfast bench pipeline` (pyfast.benchmarks.pipeline.run: every provider interleaved
in one run, with the bubble, overhead per action and activation memory).
"""
import os

import pytest
import torch.nn.functional as F

from pyfast.benchmarks import pipeline

SIZES = {**pipeline.MODELS, "small": (64, 16)}
PROVIDERS = ([f"pyfast {s}" for s in pipeline.SCHEDULES]
             + [f"torch {c}" for c, _ in pipeline.TORCH.values()])


@pytest.fixture(scope="module")
def size(request):
    default = "small" if request.config.getoption("benchmark_disable") else "large"
    return SIZES[os.environ.get("PYFAST_BENCH_PIPELINE", default)]


@pytest.fixture(scope="module")
def ranks(size):
    with pipeline.ranks(2) as launch:
        assert sorted(launch.call(pipeline._setup, *size)[0]) == sorted(PROVIDERS)
        yield launch


@pytest.mark.parametrize("provider", PROVIDERS)
def test_pipeline_step(benchmark, ranks, size, provider):
    r = ranks
    r.call(pipeline._round, [provider])  # first step: shapes are exchanged
    out = benchmark.pedantic(lambda: r.call(pipeline._round, [provider]), rounds=5,
                             warmup_rounds=1)
    slowest = max(rank[provider][0] for rank in out)
    benchmark.extra_info.update(ranks=2, width=size[0], batch=size[1], microbatches=pipeline.M,
                                step_s_slowest_rank=slowest)
    got = sum(rank[provider] for rank in r.call(pipeline._grad_sq, [provider]))
    assert got == pytest.approx(reference_grad_sq(*size), rel=1e-4), provider


def reference_grad_sq(width, rows):
    """The same step in one process, in the same micro-batches: the gradients' squared norm."""
    seq, (x, t) = pipeline.model(width), pipeline.batch(width, rows)
    for xc, tc in zip(x.chunk(pipeline.M), t.chunk(pipeline.M)):
        (F.mse_loss(seq(xc), tc) / pipeline.M).backward()
    return float(sum(p.grad.double().pow(2).sum() for p in seq.parameters()))
