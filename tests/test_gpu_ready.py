"""GPU-ready code paths, checked without a GPU.

1. Every buffer the collectives allocate follows the device of the tensor it serves. The ranks
   run with torch.set_default_device("meta") while every user tensor is made on the CPU
   explicitly: a buffer made without a device (torch.empty(n), torch.tensor([...])) becomes a
   meta tensor, which gloo cannot send and CPU arithmetic refuses to mix with, so the call fails.
   Covered: comm.all_reduce for every compressor (with error feedback for the dense ones), both
   dense algorithms, the pipelined path and the reference functions (PYFAST_COMM_REFERENCE=1),
   sync and async; comm.reduce_scatter / all_gather; the native engine; compressor="auto"'s
   agreement. Results are checked too (a meta tensor has no values): against the exact sum for
   "none", bit-identical across ranks for all.
2. No "cpu" device literal in pyfast/comm or pyfast/parallel except on lines that say why
   (`# cpu-literal: <reason>`).
3. CUDA tensors never go through gloo: a group without a CUDA backend other than gloo is
   refused by name (FakeTensors claim cuda:0 without a GPU).
"""
import ast
import io
import pathlib
import tokenize

import pytest
import torch

from dist_utils import run_ranks

ROOT = pathlib.Path(__file__).parents[1]
SPECS = ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk:0.05", "randomk:0.1",
         "powersgd:2"]
DENSE = ["fp16", "bf16", "int8", "int4", "fp8", "sign"]
N = 3001  # ragged: not a multiple of the 512-element block, of 8 or of the world size
CPU = torch.device("cpu")


def _x(rank, n=N, seed=0):
    g = torch.Generator(device=CPU).manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g, device=CPU) * (rank + 1)


def _where(e: BaseException) -> str:
    """file:line of the deepest pyfast frame of the error (of its cause, for a CommError)."""
    import traceback
    err = e.__cause__ or e
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/pyfast/" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename[f.filename.rindex('/pyfast/') + 1:]}:{f.lineno}"


def _run_all(rank, world):
    """Every path once; returns {case: result or 'error text'}."""
    import os
    from types import SimpleNamespace

    import pyfast.comm as comm
    import pyfast.compress as C
    from pyfast.comm.auto import AutoSelector
    from pyfast.comm.engine import NativeEngine

    torch.set_default_device("meta")
    out = {}

    def case(key, fn):
        try:
            r = fn()
            assert r.device == CPU, f"result on {r.device}"
            out[key] = r.detach().reshape(-1).clone()
        except Exception as e:  # reported by the test, every case at once, with its place
            out[key] = f"{_where(e)}: {type(e).__name__}: {e}"

    for mode in ("pipelined", "reference"):
        os.environ.pop("PYFAST_COMM_REFERENCE", None)
        os.environ["PYFAST_COMM_CHUNK"] = "1024"  # several pieces in flight for N elements
        if mode == "reference":
            os.environ["PYFAST_COMM_REFERENCE"] = "1"
        for spec in SPECS:
            algos = ["two-phase", "allgather"] if spec in DENSE else [None]
            for algo in algos:
                for ef in ((False, True) if spec in DENSE or spec.startswith("topk") else (False,)):
                    c = C.WithFeedback(C.get(spec)) if ef else C.get(spec)
                    shape = (7, -1) if spec.startswith("powersgd") else (-1,)
                    n = 7 * 429 if spec.startswith("powersgd") else N
                    for dt in (torch.float32, torch.bfloat16):
                        t = _x(rank, n).to(dt).view(*shape)
                        case((mode, spec, algo, ef, dt),
                             lambda: comm.all_reduce(t, c, name="g", algorithm=algo))
            h = comm.all_reduce(_x(rank), spec if spec != "powersgd:2" else "int8",
                                async_op=True, name="a")
            case((mode, spec, "async"), h.wait)
    os.environ.pop("PYFAST_COMM_REFERENCE", None)

    for spec in SPECS[:-1]:  # powersgd has no reduce_scatter / all_gather
        for dt in (torch.float32, torch.float16):
            t = _x(rank, world * 1023).to(dt)
            case(("rs", spec, dt), lambda: comm.reduce_scatter(
                torch.empty(1023, dtype=dt, device=CPU), t, spec, name="r"))
            t = _x(rank, 1023).to(dt)
            case(("ag", spec, dt), lambda: comm.all_gather(
                torch.empty(world * 1023, dtype=dt, device=CPU), t, spec, name="r"))
    h = comm.reduce_scatter(torch.empty(1023, device=CPU), _x(rank, world * 1023), "int8",
                            async_op=True)
    case(("rs", "async"), h.wait)

    engine = NativeEngine()
    for spec in ["none"] + DENSE:
        for algo in ([None] if spec == "none" else ["two-phase", "allgather"]):
            c = C.WithFeedback(C.get(spec)) if spec != "none" else C.get(spec)
            t = _x(rank)
            case(("engine", spec, algo), lambda: engine.all_reduce(t, c, name="e",
                                                                   algorithm=algo).wait())
    g = torch.empty(world * 50, device=CPU)
    case(("engine", "all_gather_into"), lambda: engine.all_gather_into(g, _x(rank, 50)).wait())
    p = torch.empty(50, device=CPU)
    case(("engine", "reduce_scatter_into"),
         lambda: engine.reduce_scatter_into(p, _x(rank, world * 50)).wait())
    engine.close()

    bucket = SimpleNamespace(flat=_x(rank, 4096), index=0, name="b0")
    sel = AutoSelector([bucket], None, error_feedback=True)

    def auto():
        for s in range(4):  # warm-up, decide (agreement on costs), check and try "none"
            sel.after_step([0.01 * (s + 1)])  # (agreements on times)
        return torch.tensor([float(sel.fixed)], device=CPU)
    case(("auto",), auto)
    return out


def _both(rank, world):
    """One spawn for both checks: ranks cost ~2-5 s each to start here."""
    return _run_all(rank, world), _cuda_on_gloo(rank, world)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_both, 2, timeout=300)


def test_collectives_allocate_on_the_inputs_device(ranks):
    world = 2
    out = [r[0] for r in ranks]
    errors = {k: v for o in out for k, v in o.items() if isinstance(v, str)}
    assert not errors, "\n".join(f"{k}: {v[:300]}" for k, v in errors.items())
    scattered = [k for k in out[0] if k[0] == "rs" or k[-1] == "reduce_scatter_into"]
    for key, got in out[0].items():
        if key not in errors and key not in scattered:
            assert torch.equal(got, out[1][key]), f"{key}: ranks differ"
    both = _x(0, world * 1023) + _x(1, world * 1023)
    torch.testing.assert_close(torch.cat([o["rs", "none", torch.float32] for o in out]), both,
                               rtol=1e-6, atol=1e-6)
    exact = _x(0) + _x(1)
    for mode in ("pipelined", "reference"):
        torch.testing.assert_close(out[0][mode, "none", None, False, torch.float32], exact,
                                   rtol=1e-6, atol=1e-6)
        err = (out[0][mode, "int8", "two-phase", True, torch.float32] - exact).abs().max()
        assert err < 0.1 * exact.abs().max(), f"int8 {mode}: error {err}"
    torch.testing.assert_close(out[0]["engine", "none", None], exact, rtol=1e-6, atol=1e-6)


def cpu_literals(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """'file:line: text' for each string literal equal to "cpu" on a line without a
    `# cpu-literal:` comment. Tokens, not text: docstrings and comments do not count."""
    src = path.read_text()
    lines = src.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.STRING:
            continue
        try:
            value = ast.literal_eval(tok.string)  # f-strings are not literals: ValueError
        except (ValueError, SyntaxError):
            continue
        if value != "cpu":
            continue
        row = tok.start[0]
        if "# cpu-literal:" not in lines[row - 1]:
            found.append(f"{path.relative_to(root)}:{row}: {lines[row - 1].strip()}")
    return found


def test_cpu_literal_finder_sees_literals_only(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""A docstring that says "cpu"."""\n'
                 'a = torch.device("cpu")  # says cpu\n'
                 "b = 'cpu'  # cpu-literal: documented\n"
                 'c = f"{x}cpu"\n'
                 'd = "cpu:0"\n')
    found = cpu_literals(f, tmp_path)
    assert found == ['m.py:2: a = torch.device("cpu")  # says cpu'], found


@pytest.mark.parametrize("package", ["pyfast/comm", "pyfast/parallel"])
def test_no_cpu_literal_outside_documented_places(package):
    found = [hit for f in sorted((ROOT / package).rglob("*.py")) for hit in cpu_literals(f)]
    assert not found, ('"cpu" literals without a `# cpu-literal: <why>` comment (allocate on '
                       "the device of the tensor served instead):\n" + "\n".join(found))


def test_device_backends_parses_the_config():
    from pyfast.comm.collectives import device_backends
    assert device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends("nccl") == {"*": "nccl"}


def _cuda_on_gloo(rank, world):
    """FakeTensors on cuda:0 (no memory, no GPU) reach the device checks and nothing more."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    import pyfast.comm as comm
    from pyfast.comm.collectives import check_backend
    with FakeTensorMode():
        fake, half = torch.empty(1024, device="cuda"), torch.empty(512, device="cuda")
    found = {"config": dist.get_backend_config()}
    group = dist.new_group(backend="gloo")  # every rank makes it: new_group is collective
    calls = {
        "all_reduce": lambda: comm.all_reduce(fake, "int8", name="bucket3"),
        "all_reduce-async": lambda: comm.all_reduce(fake, "none", async_op=True).wait(),
        "reduce_scatter": lambda: comm.reduce_scatter(half, fake, "int8"),
        "all_gather": lambda: comm.all_gather(fake, half, "topk:0.1"),
        "group": lambda: comm.all_reduce(fake, "fp16", group=group),
    }
    for key, call in calls.items():
        try:
            call()
            found[key] = "no error"
        except ValueError as e:
            found[key] = str(e)
    check_backend(torch.device("cpu"))  # CPU tensors: gloo is their backend
    return found


def test_cuda_tensors_never_go_through_gloo(ranks):
    found = ranks[0][1]
    assert "cuda:gloo" in found.pop("config")
    for key, msg in found.items():
        assert "cuda:0" in msg and "NCCL" in msg and "gloo" in msg, f"{key}: {msg}"
    assert found["all_reduce"].startswith("all_reduce of bucket3"), found["all_reduce"]
