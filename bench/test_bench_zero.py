"""`pyfast bench zero` runs end to end on a tiny GPT (one step per phase): it cannot rot."""
import io

from pyfast import perf
from pyfast.benchmarks import zero

TINY = dict(n_layer=1, n_head=2, d_model=32)


def test_zero_bench_runs():
    configs = ["torch DDP", "torch FSDP2", "pyfast zero3 int8+int8p"]
    res = zero.run(links=("loopback",), configs=configs, batch=1, seq=16, steps=1, warmup=0,
                   mem_steps=2, model=TINY)
    assert [r["config"] for r in res["rows"]] == configs
    assert all(r["median_s"] > 0 for r in res["rows"])
    mem = {r["config"]: r for r in res["memory"]}
    # the tensor accounting is the fp32 ZeRO model for DDP, plus AdamW's 4-byte step per tensor
    n_tensors = len(list(zero.build_model(16, TINY).parameters()))
    assert mem["torch DDP"]["state"] == mem["torch DDP"]["model_bytes"] + 4 * n_tensors
    assert mem["torch FSDP2"]["state"] < mem["torch DDP"]["state"]
    assert res["rows"][2]["loss0_diff"] < zero.TOL_PARAM_COMPRESSED
    text = io.StringIO()
    perf.show(res, zero.table, file=text)
    assert "pyfast zero3 int8+int8p" in text.getvalue() and "peak in step" in text.getvalue()
