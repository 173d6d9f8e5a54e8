"""`pyfast bench data` end to end at tiny sizes (0.3 MB of text, gpt-tiny): it cannot rot."""
import io

from pyfast import perf
from pyfast.benchmarks import data


def test_data_bench_runs():
    res = data.run(mb=0.3, bpe=300, repeats=1, rss_mb=(0.2,), steps=5, model="gpt-tiny",
                   batch=2, seq=16, step_repeats=2)
    assert {(r["tokenizer"], r["workers"]) for r in res["rows"]} == {
        ("bytes", 1), ("bytes", 2), ("bpe", 1), ("bpe", 2)}
    assert all(r["mb_per_s"] > 0 for r in res["rows"])
    assert res["step"]["data_s"] > 0 and res["step"]["compute_s"] > 0
    rss = {(round(r["mb"], 1), r["path"]): r for r in res["rss"]}
    assert set(rss) == {(0.2, "prepared (memmap)"), (0.2, "text file (read)")}
    # bytes: one token per byte of text plus one EOS per document
    assert 0.2 * 2**20 < rss[0.2, "prepared (memmap)"]["tokens"] < 0.21 * 2**20
    text = io.StringIO()
    perf.show(res, data.table, file=text)
    assert "MB/s" in text.getvalue() and "fwd+bwd" in text.getvalue()
