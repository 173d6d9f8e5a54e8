"""Every buffer on the device of the tensors it serves, checked without a GPU: one process joins
torch's `fake` process group (world 2, collectives move nothing) and its tensors live on `meta`,
a device that gloo and the CPU cannot touch, so anything made on the CPU where it should follow
the data (an agreement digest, a norm accumulator, a loaded error-feedback memory) shows up as
a CPU tensor or an error. The fake backend serves cpu and cuda, not meta, which stands in for a
CPU batch on an NCCL-only group (the backend does not serve the data's device)."""
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pyfast.compress as C

META = torch.device("meta")


pytestmark = pytest.mark.usefixtures("fake_world")  # tests/conftest.py


def _net(device):
    with torch.device(device):  # ragged sizes: 13 -> 37 -> 3
        return nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 3))


@pytest.fixture
def gathers(monkeypatch):
    """The devices agree()'s digest exchange receives (it answers as if every rank agreed)."""
    seen = []

    def record(out, inp, group=None, async_op=False):
        seen.append(inp.device)
        out.copy_(inp.repeat(out.numel() // inp.numel()))
    monkeypatch.setattr(dist, "all_gather_single", record)
    return seen


def test_agreement_digest_travels_on_a_device_the_backend_serves(gathers):
    from pyfast.parallel.context import check_args, shard_sequence
    x = torch.randn(2, 3, 12, 5, device=META)
    assert shard_sequence(x, dim=2, layout="zigzag").shape == (2, 3, 6, 5)
    q = torch.randn(1, 2, 6, 4, device=META)
    check_args(q, q, q, None, True, "ring", "zigzag", None)
    # before the fix the digest was made on the data's device (meta) and the check failed
    assert gathers == [torch.device("cpu")] * 2, gathers


@pytest.mark.parametrize("config,data,want", [
    ("cuda:nccl", "cpu", "cuda:0"),        # a CPU batch sharded on an NCCL-only group
    ("nccl", "cpu", "cuda:0"),
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
    ("cpu:gloo,cuda:nccl", "cuda:0", "cuda:0"),
    ("gloo", "cpu", "cpu"),
    ("gloo", "meta", "cpu"),
])
def test_exchange_device(monkeypatch, config, data, want):
    from pyfast.comm import agree
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a device object needs no GPU
    assert agree.exchange_device(None, torch.device(data)) == torch.device(want)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_clip_accumulator_on_the_parameters_device(stage):
    from pyfast.parallel import zero
    torch.set_default_device("meta")  # a tensor made without a device becomes meta
    try:
        m = _net("cpu")
        model, opt = zero(m, torch.optim.AdamW, stage=stage, engine="python", lr=1e-2)
        model(torch.randn(8, 13, device="cpu")).square().mean().backward()
        for norm_type in (2.0, float("inf")):
            total = opt.clip_grad_norm_(1.0, norm_type)
            assert total.device == torch.device("cpu") and torch.isfinite(total), (norm_type, total)
        model.close()
    finally:
        torch.set_default_device(None)


def _cpu_memory(c, n=40):
    """A checkpoint's compression state as saved (state_dict() puts the memory on the CPU)."""
    return {"compressor": c.inner.state_dict(), "feedback": {"memory": {"b0": torch.randn(n)}}}


def test_feedback_memory_restored_onto_the_parameters_device():
    from pyfast.hooks import CompressionState
    from pyfast.parallel import zero
    from pyfast.parallel.data import DataParallel
    torch.set_default_device("meta")
    try:
        dp = DataParallel(_net(META), "int8")
        dp.load_compression_state_dict({"spec": "int8", "state": _cpu_memory(dp.compressor)})
        assert dp.compressor.feedback.memory["b0"].device == META
        dp.close()
        model, _ = zero(_net(META), torch.optim.AdamW, stage=2, compressor="int8", lr=1e-2)
        model.compressor.load_state_dict(_cpu_memory(model.compressor))  # pyfast train's path
        assert model.compressor.feedback.memory["b0"].device == META
        model.close()
        st = CompressionState("int8")
        st.load_state_dict({"spec": "int8", "iter": 3, "compressor": _cpu_memory(st.compressor)},
                           device=META)
        assert st.compressor.feedback.memory["b0"].device == META
    finally:
        torch.set_default_device(None)
    # where the device is not known at load (a hook's state before its first bucket), the
    # memory moves to the tensor it serves when first used, and keeps its values
    c = C.wrap(C.get("sign"))
    state = _cpu_memory(c)
    c.load_state_dict(state)
    assert c.feedback.memory["b0"].device == torch.device("cpu")
    c.compress(torch.randn(40, device=META), "b0")
    assert c.feedback.memory["b0"].device == META


def test_engine_auto_asks_the_engine_about_the_device(caplog):
    from pyfast import _C
    from pyfast.comm.engine import status
    from pyfast.parallel import zero
    from pyfast.parallel.data import DataParallel
    ok, why = status(META)
    assert not ok and "meta" in why, why
    ok, why = status(torch.device("cuda", 0))
    assert ok == bool(_C.Engine.cuda_enabled), why  # this CPU build: refused, by name
    if not _C.Engine.cuda_enabled:
        assert "without CUDA" in why, why
    native_here, _ = status(torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="pyfast.parallel"):
        for device, want in (("cpu", "native" if native_here else "python"), (META, "python")):
            caplog.clear()
            dp = DataParallel(_net(device), "int8")
            assert dp.engine == want and dp.engine_kind == [want], (device, dp.engine)
            said = [r.getMessage() for r in caplog.records if "engine='auto'" in r.getMessage()]
            assert len(said) == 1 and want in said[0], said  # logged once, naming the choice
            dp.close()
        model, _ = zero(_net(META), torch.optim.AdamW, stage=2, compressor="int8", lr=1e-2)
        assert model.engine_kind == {"reduce_scatter": "python", "all_gather": "python"}
        model.close()
