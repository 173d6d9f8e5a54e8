"""The native overlap engine (pyfast._C.Engine through pyfast.comm.engine) at 2 and 4 gloo ranks.

Its uncompressed all_gather_into / reduce_scatter_into jobs are checked against
dist.all_gather_into_tensor and an fp32 sum in rank order, queued between compressed jobs.

Oracle: pyfast.comm.all_reduce on the same inputs, both its pipelined path (chunks of 4096
elements, so a 70K tensor is many pieces in flight) and its reference functions
(PYFAST_COMM_REFERENCE=1). The engine must match it bitwise (the output and every
error-feedback memory, by name), over two steps so that the memories feed back, with all of a
step's jobs queued before the first wait and waited in reverse order (FIFO on the worker keeps
the collectives in step across ranks). A failing collective must surface from wait(), not hang.
"""
import pytest
import torch

from dist_utils import RankPool, run_ranks

KINDS = ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign"]
CASES = [(k, a, fb) for k in KINDS for a in ([None] if k == "none" else ["two-phase", "allgather"])
         for fb in (False, True)]
SIZES = [70_007, 100]  # ragged; 100 leaves two-phase parts empty at W=4 (and W=2: block 512)


def inputs(rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1)


def bits(t):
    return t.view(torch.int32)


def _worker(rank, world, mode):
    import os

    import pyfast.comm as comm
    import pyfast.compress as C
    from pyfast.comm.engine import NativeEngine
    for var in ("PYFAST_COMM_REFERENCE", "PYFAST_COMM_CHUNK"):  # the pool's previous job's
        os.environ.pop(var, None)
    os.environ["PYFAST_COMM_REFERENCE" if mode == "reference" else "PYFAST_COMM_CHUNK"] = \
        "1" if mode == "reference" else "4096"
    engine = NativeEngine()
    make = lambda k, fb: C.WithFeedback(C.get(k)) if fb else C.get(k)  # noqa: E731
    cases = [(n, *c) for n in SIZES for c in CASES]
    mine = {c: (inputs(rank, c[0]), make(c[1], c[3])) for c in cases}
    ref = {c: (inputs(rank, c[0]), make(c[1], c[3])) for c in cases}
    bad = []
    for step in range(2):
        handles = [(c, engine.all_reduce(mine[c][0], mine[c][1], "avg" if i % 2 else "sum",
                                         "g", c[2]))
                   for i, c in enumerate(cases)]
        for c, h in reversed(handles):
            h.wait()
            assert h.seconds > 0, f"{c}: seconds {h.seconds}"
        for i, c in enumerate(cases):
            comm.all_reduce(ref[c][0], ref[c][1], op="avg" if i % 2 else "sum", name="g",
                            algorithm=c[2])
            if not torch.equal(bits(mine[c][0]), bits(ref[c][0])):
                bad.append(f"step {step} {c}: output differs from pyfast.comm.all_reduce")
            if c[3]:
                a, b = mine[c][1].feedback.memory, ref[c][1].feedback.memory
                if a.keys() != b.keys() or any(not torch.equal(bits(a[k]), bits(b[k])) for k in a):
                    bad.append(f"step {step} {c}: error feedback {sorted(a)} vs {sorted(b)}")
    if mode == "pipelined":  # once per world size
        bad += _uncompressed_jobs(engine, rank, world)
    return bad, {c: mine[c][0] for c in cases}


def _uncompressed_jobs(engine, rank, world):
    """all_gather_into / reduce_scatter_into against dist.all_gather_into_tensor and an fp32 sum
    in rank order, queued together with compressed jobs (FIFO keeps them in step)."""
    import torch.distributed as dist
    bad = []
    shapes = [(7,), (3, 50), (1000,)]  # per-rank part; out / in may be 2-D
    xs = [inputs(rank, world * n).view(world * s[0], *s[1:]) for s in shapes
          for n in [torch.Size(s).numel()]]
    gathered = [torch.empty(world * x.numel()) for x in xs]
    parts = [torch.empty(x.shape[0] // world, *x.shape[1:]) for x in xs]
    extra = inputs(rank, 5000)
    hs = []
    for i, (x, g, p) in enumerate(zip(xs, gathered, parts)):
        hs.append(engine.all_gather_into(g, x))
        hs.append(engine.reduce_scatter_into(p, x, "avg" if i % 2 else "sum"))
        hs.append(engine.all_reduce(extra, "int8", name="between"))
    for h in reversed(hs):
        h.wait()
    for i, (x, g, p) in enumerate(zip(xs, gathered, parts)):
        ref = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(ref, x.reshape(-1))
        if not torch.equal(bits(g), bits(ref)):
            bad.append(f"all_gather_into {tuple(x.shape)}: differs from all_gather_into_tensor")
        every = ref.view(world, world, -1)[:, rank]  # every rank's part `rank`, in rank order
        acc = every[0].clone()
        for r in range(1, world):
            acc += every[r]
        if i % 2:
            acc /= world
        if not torch.equal(bits(p.reshape(-1)), bits(acc)):
            bad.append(f"reduce_scatter_into {tuple(x.shape)}: differs from the rank-order sum")
    for call, words in [(lambda: engine.all_gather_into(torch.empty(world * 7 + 1), xs[0]),
                         "needs an output of"),
                        (lambda: engine.reduce_scatter_into(torch.empty(2),
                                                            torch.ones(2 * world + 1)),
                         "needs an input of"),
                        (lambda: engine.all_gather_into(torch.empty(world, dtype=torch.float64),
                                                        torch.ones(1, dtype=torch.float64)),
                         "float32"),
                        (lambda: engine.reduce_scatter_into(parts[0], xs[0], "max"), "op must be")]:
        try:
            call()
            bad.append(f"no error, expected {words!r}")
        except (ValueError, RuntimeError) as e:
            if words not in str(e):
                bad.append(f"expected {words!r}, got {e}")
    return bad


@pytest.fixture(scope="module", params=[2, 4])
def pool(request):
    """Ranks spawned once per world size for both modes (a spawn costs ~2 s a rank here)."""
    with RankPool(request.param) as p:
        yield p


@pytest.mark.parametrize("mode", ["pipelined", "reference"])
def test_engine_matches_all_reduce_bitwise(pool, mode):
    world = pool.world_size
    out = pool.run(_worker, mode)
    for rank, (bad, _) in enumerate(out):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
    for c, t in out[0][1].items():
        for r in range(1, world):
            assert torch.equal(bits(out[r][1][c]), bits(t)), f"{c}: rank {r} differs from rank 0"


def _errors(rank, world):
    import datetime
    import time

    import torch.distributed as dist

    import pyfast.compress as C
    from pyfast import _C
    from pyfast.comm.engine import NativeEngine
    found = {}
    # Bad arguments fail on the caller's thread, naming the problem.
    engine = NativeEngine()
    assert NativeEngine.supports("int8") and NativeEngine.supports(C.WithFeedback(C.get("sign")))
    assert not NativeEngine.supports("topk:0.1") and not NativeEngine.supports("powersgd:2")
    assert not NativeEngine.supports(C.get("int8", stochastic=True))
    for call, words in [
            (lambda: engine.all_reduce(torch.ones(8), "topk:0.1"), "does not run"),
            (lambda: engine.all_reduce(torch.ones(8, dtype=torch.bfloat16), "int8"), "float32"),
            (lambda: engine._engine.submit(torch.ones(8), "int9", 512, "allgather", False, [],
                                           512, 0), "unknown compression kind"),
            (lambda: engine._engine.submit(torch.ones(8), "int8", 512, "allgather", False,
                                           [torch.zeros(7)], 512, 0), "holds 7 elements")]:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=words):
            call()
    # Dropping the engine with jobs queued runs them (every rank issued them) and joins.
    ts = [torch.full((1000,), float(rank + 1)) for _ in range(3)]
    hs = [engine.all_reduce(t, "none") for t in ts]
    del engine, hs
    found["drained"] = all(torch.equal(t, torch.full((1000,), world * (world + 1) / 2)) for t in ts)
    # A collective that times out on the worker raises from wait(); later jobs are refused
    # (the ranks may be out of step) instead of being paired with another rank's next bucket.
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    if rank == 0:  # rank 1 never joins
        engine = NativeEngine(group)
        t0 = time.perf_counter()
        first, second = engine.all_reduce(torch.ones(10), "int8"), engine.all_reduce(torch.ones(10), "int8")
        for key, h in (("first", first), ("second", second)):
            with pytest.raises(RuntimeError) as e:
                h.wait()
            found[key] = str(e.value)
        found["seconds"] = time.perf_counter() - t0
        with pytest.raises(RuntimeError):  # a handle re-raises, it does not wait again
            first.wait()
        del engine
    dist.barrier()
    return found


def test_engine_errors_surface_and_never_hang():
    found = run_ranks(_errors, 2)
    assert found[0]["drained"] and found[1]["drained"]
    assert "job 0" in found[0]["first"] and "Timed out" in found[0]["first"], found[0]["first"]
    assert "not run" in found[0]["second"] and "job 0" in found[0]["second"], found[0]["second"]
    assert found[0]["seconds"] < 20, f"timeout took {found[0]['seconds']:.1f} s"


def _refuses_cuda(rank, world):
    """A FakeTensor claims cuda:0 without memory or a GPU: enough to reach the device checks of
    NativeEngine and of the C++ engine, and nothing more (no CUDA code runs here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pyfast.comm.engine import NativeEngine
    engine = NativeEngine()
    with FakeTensorMode():
        fake = torch.empty(8, device="cuda")
    assert fake.device.type == "cuda"
    found = {}
    for key, call in [
            ("all_reduce", lambda: engine.all_reduce(fake, "int8")),
            ("reduce_scatter_into", lambda: engine.reduce_scatter_into(torch.empty(8), fake)),
            ("C++ submit", lambda: engine._engine.submit(fake, "int8", 512, "allgather", False,
                                                         [], 512, 0)),
            ("C++ submit_all_gather", lambda: engine._engine.submit_all_gather(torch.empty(8),
                                                                               fake))]:
        try:
            call()
            found[key] = "no error"
        except RuntimeError as e:
            found[key] = str(e)
    engine.close()
    return found


def test_engine_refuses_cuda_tensors_without_a_cuda_build():
    """This machine's pyfast._C is the CPU build: CUDA tensors are refused by name, in Python
    and in C++. The CUDA path itself is only compiled here (make cuda-check), never run."""
    from pyfast import _C
    from pyfast.comm.engine import check_device
    if _C.Engine.cuda_enabled:
        pytest.skip("pyfast._C is a CUDA build: the refusal does not apply")
    with pytest.raises(RuntimeError, match="pyfast._C was built without CUDA"):
        check_device(torch.device("cuda", 0))  # a device object needs no GPU
    check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU and CUDA"):  # a wrong device is a wrong value
        check_device(torch.device("meta"))
    for key, msg in run_ranks(_refuses_cuda, 1)[0].items():
        assert msg.startswith("pyfast._C was built without CUDA") and "cuda:0" in msg, \
            f"{key}: {msg}"


def _cuda_check():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "tools" / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("cuda_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cuda_check_compiles_the_engines_cuda_half():
    """make cuda-check (tools/cuda_check.py) compiles the engine's CUDA file with the CUDA
    build's macro, from the same glob setup.py adds to the CUDAExtension."""
    import pathlib
    cc = _cuda_check()
    assert "csrc/cuda/engine_cuda.cu" in cc.sources(), cc.sources()
    assert {"csrc/cuda/quantize.cu", "csrc/cuda/topk.cu"} <= set(cc.sources())
    assert "-DPYFAST_WITH_CUDA" in cc.nvcc_flags()
    setup = (pathlib.Path(cc.ROOT) / "setup.py").read_text()
    assert f'glob.glob("{cc.SOURCES}")' in setup and "-DPYFAST_WITH_CUDA" in setup


def test_cuda_check_fails_loudly(tmp_path):
    import shutil
    import subprocess
    import sys
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    bad = tmp_path / "bad.cu"
    bad.write_text("int f() { return undeclared_name; }\n")
    p = subprocess.run([sys.executable, _cuda_check().__file__, "--nvcc", nvcc, str(bad)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED" in p.stdout and "undeclared_name" in p.stderr, p.stdout + p.stderr
