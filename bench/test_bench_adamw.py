"""`pyfast bench adamw` at a small size, once, so it cannot rot (`make test` runs it with
--benchmark-disable); the recorded numbers come from `pyfast bench adamw --out
bench/results/adamw` (docs/benchmarks.md)."""
import torch

from conftest import NUMEL
from pyfast.benchmarks import adamw


def test_adamw_bench_runs_every_provider_and_prints_the_roof():
    threads = torch.get_num_threads()
    try:
        r = adamw.run([NUMEL], [NUMEL], repeats=1, threads=1, roof_numel=NUMEL)
    finally:
        torch.set_num_threads(threads)
    assert [c["dtype"] for c in r["cases"]] == ["float32", "bfloat16"]
    for c in r["cases"]:
        assert set(c["rows"]) == set(adamw.PROVIDERS) and c["roof_s"] > 0
        assert sum(adamw.ragged(c["numel"])) == c["numel"] == NUMEL
    assert "roof" in adamw.table(r)
