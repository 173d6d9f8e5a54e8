"""CUDA tensors through NCCL on one GPU: pyfast's compressed all-reduce (Python path and the
native engine's CUDA half, csrc/cuda/engine_cuda.cu) and a DataParallel step. Skipped without a
CUDA device (every CI machine); tools/gpu_check.sh runs it where one is lent.

One GPU gives a world of one: NCCL refuses two ranks on one device ("Duplicate GPU detected"),
so what this proves is that every tensor, payload and feedback buffer of these paths lives on
the GPU and NCCL accepts it, and that the engine's side-stream path computes what the Python
path does (bitwise: the same kernels on the same values), not multi-rank behaviour (the NCCL
lane and the gloo tests cover pairing and sums).
"""
import copy

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def nccl():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("spec", ["none", "bf16", "int8", "int4", "topk:0.01"])
def test_compressed_all_reduce_on_cuda(nccl, spec):
    import pyfast.comm as comm
    x = torch.randn(1_000_003, device=CUDA) * torch.exp(torch.randn(1_000_003, device=CUDA))
    y = comm.all_reduce(x.clone(), spec, group=nccl, name="g")
    assert y.device.type == "cuda" and torch.isfinite(y).all()
    if spec == "none":
        assert torch.equal(y, x)
    else:  # a world of one sends its own encoding: at most the codec's error
        assert float((y - x).norm() / x.norm()) < 1.0


@pytest.mark.parametrize("spec", ["none", "int8", "int4", "fp8", "sign"])
def test_native_engine_cuda_matches_python_path(nccl, spec):
    from pyfast import _C
    from pyfast.comm.engine import NativeEngine
    import pyfast.comm as comm
    if not _C.Engine.cuda_enabled:
        pytest.fail("pyfast._C was built without CUDA on a machine with a GPU: rebuild it")
    x = torch.randn(3 * 2 ** 20 + 17, device=CUDA)
    engine = NativeEngine(nccl)
    try:
        got = x.clone()
        engine.all_reduce(got, spec, name="e").wait()
    finally:
        engine.close()
    want = comm.all_reduce(x.clone(), spec, group=nccl, name="p")
    assert got.device.type == "cuda"
    if spec != "sign":  # amax scales: order-free, so the same codes bit for bit
        assert torch.equal(got, want), float((got - want).abs().max())
    else:  # sign's scale is a mean of |x| over a 512-block, summed in another order by the
        # path's kernel (seen on the H200: 2 ulp apart); two orders of a sum of n non-negative
        # fp32 terms differ by at most 2 (n - 1) u of it, u = 2^-24
        bound = 2 * 511 * 2.0 ** -24 * want.abs()
        assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


@pytest.mark.parametrize("engine", ["python", "native"])
def test_data_parallel_step_on_cuda(nccl, engine):
    from pyfast.parallel.data import DataParallel
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.LayerNorm(129),
                              torch.nn.GELU(), torch.nn.Linear(129, 11)).to(CUDA)
    ref = copy.deepcopy(net)
    x = torch.randn(64, 37, device=CUDA)
    ref(x).square().mean().backward()
    dp = DataParallel(net, "int8", group=nccl, engine=engine)
    try:
        dp(x).square().mean().backward()
        assert dp.engine == engine
        for (name, p), r in zip(net.named_parameters(), ref.parameters()):
            assert p.grad is not None and p.grad.device.type == "cuda", name
            # one int8 encoding of each bucket: blockwise error ~1.6% of the norm
            # (bench/results/block_size.txt), 5% allows heavy-tailed small tensors
            err = float((p.grad - r.grad).norm() / r.grad.norm())
            assert err < 0.05, (name, err)
    finally:
        dp.close()



class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.unused = torch.nn.Linear(33, 17), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.a(x)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_data_parallel_unused_parameter_on_cuda(nccl, engine):
    """The side band's CUDA path: flags copied from pinned memory without a host sync, the sum
    read only for a parameter this rank left without a gradient (comm.ready.SideBand); the
    exposed-wait time from CUDA events."""
    from pyfast.parallel.data import DataParallel
    torch.manual_seed(1)
    net = _TwoHeads().to(CUDA)
    ref = copy.deepcopy(net)
    x = torch.randn(8, 33, device=CUDA)
    dp = DataParallel(net, "none", group=nccl, engine=engine)
    try:
        for _ in range(2):
            net.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            dp(x).square().mean().backward()
            ref(x).square().mean().backward()
            assert net.unused.weight.grad is None and net.unused.bias.grad is None
            for p, r in zip(net.a.parameters(), ref.a.parameters()):
                assert torch.equal(p.grad, r.grad)  # a world of one: the sum of one
            assert dp.last_wait_s >= 0.0
    finally:
        dp.close()
