"""The measurements of `pyfast bench gpu` (pyfast.benchmarks.gpu), one function a part.

Each takes (device, small) and returns a JSON-able dict. Timing (`timed`): the median of
REPEATS calls, each after the last-level cache was flushed by writing a buffer FLUSH_X its size
(so every call reads its input from memory, not from a 50-60 MB L2 that a 64 MB tensor half
fits), CUDA events around the call on a GPU, perf_counter on the CPU. `small` (tests, CPU):
sizes a CPU runs in seconds; the rates are then the CPU's, not a target run.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

REPEATS = 7     # the floor: medians of >= 7
FLUSH_X = 4     # flush buffer / last-level cache
GiB = 1 << 30


def _l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 32 << 20  # a server CPU's L3 slice is of this order; the exact size matters little


def timed(fn, device: torch.device, repeats: int = REPEATS, flush: bool = True) -> float:
    """Median seconds of fn() over `repeats` calls after one warm call, the cache flushed
    before each (not timed)."""
    buf = torch.empty(FLUSH_X * _l2_bytes(device) // 4, dtype=torch.float32, device=device) \
        if flush else None
    fn()
    ts = []
    for _ in range(repeats):
        if buf is not None:
            buf.fill_(1.0)
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def gradient(n: int, device) -> torch.Tensor:
    """pyfast bench compress's gradient-like values, flat, on the device (drawn on the CPU:
    the same values on every device)."""
    from .compress import gradient as drawn
    return drawn(n).reshape(-1).to(device)


def roof(device, small: bool) -> dict:
    """y.copy_(x) of >= 1 GiB fp32 (torch's copy kernel moves 16-byte vectors on CUDA): bytes
    read + written a second."""
    n = (1 << 22) if small else GiB // 4
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), device, flush=False)  # 2 GiB moved: no cache holds it
    return {"bytes": 2 * n * 4, "seconds": t, "GBps": 2 * n * 4 / t / 1e9}


def _backends(device) -> list[str]:
    from pyfast.ops import status
    return [b for b in ("cpp", "triton", "torch") if status(b, device)[0]
            and not (b == "triton" and device.type == "cpu")]


def quantize(device, small: bool) -> dict:
    """Each quantizer compressing n fp32 values into its codes + scales, and decompressing into
    an existing fp32 buffer, per backend that runs it here. Bytes: 4n read + codes and scales
    written; codes and scales read + 4n written."""
    from pyfast.ops import e3m0, quantize as q, ternary
    n = (1 << 20) + 3 if small else 1 << 26  # 64M: 256 MB, 4-5x an H100 / H200 L2
    x = gradient(n, device)
    out = torch.empty_like(x)
    rows = []
    for kind in ("int8", "fp8", "int4", "sign"):
        for b in _backends(device):
            codes, scales = q.quantize(x, kind, backend=b)
            tc = timed(lambda: q.quantize(x, kind, backend=b), device)
            td = timed(lambda: q.dequantize(codes, scales, n, kind, backend=b, out=out), device)
            rows.append(_row(kind, b, n, codes, scales, tc, td))
    for kind, enc, dec, bs in (("ternary", ternary.encode, ternary.decode, ("cpp", "torch")),
                               ("e3m0", e3m0.encode, e3m0.decode, ("torch",))):
        for b in bs:
            if b == "cpp" and device.type != "cpu":
                continue  # csrc/ternary.cpp has a CPU kernel only
            kw = {"backend": b} if kind == "ternary" else {}
            codes, scales = enc(x, **kw)
            tc = timed(lambda: enc(x, **kw), device)
            td = timed(lambda: out.copy_(dec(codes, scales, n, **kw)), device)
            rows.append(_row(kind, b, n, codes, scales, tc, td))
    return {"numel": n, "rows": rows}


def _row(kind, backend, n, codes, scales, tc, td) -> dict:
    payload = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    moved_c, moved_d = 4 * n + payload, payload + 4 * n
    return {"kind": kind, "backend": backend, "compress_s": tc, "decompress_s": td,
            "compress_GBps": moved_c / tc / 1e9, "decompress_GBps": moved_d / td / 1e9,
            "GBps": (moved_c + moved_d) / (tc + td) / 1e9, "wire_ratio": 4 * n / payload}


def topk(device, small: bool) -> dict:
    """1% of n by magnitude: pyfast's threshold selection (sampled threshold, counting passes,
    one select pass) and its exact radix select (topk_exact) per backend, and torch.topk of |x| (exact; its version beside it: it regressed ~5x in
    torch 2.7-2.8 on large inputs, pytorch#164459). `reads`: the time over one read of the
    input at the measured copy roof's read rate (half its bytes a second)."""
    from pyfast.ops import topk as tk
    n = (1 << 20) + 7 if small else 1 << 26
    x = gradient(n, device)
    k = tk.target(n, 0.01)[0]
    rows = [{"impl": "torch.topk(|x|)", "exact": True,
             "seconds": timed(lambda: torch.topk(x.abs(), k), device)}]
    for b in _backends(device):
        rows.append({"impl": f"pyfast topk ({b})", "exact": False,
                     "seconds": timed(lambda: tk.topk(x, 0.01, backend=b), device)})
        if b != "cpp":  # the radix select: Triton, or the reference (no C++ kernel)
            rows.append({"impl": f"pyfast topk_exact ({b})", "exact": True,
                         "seconds": timed(lambda: tk.topk_exact(x, k, backend=b), device)})
    for r in rows:
        r["us"] = r["seconds"] * 1e6
        r["input_GBps"] = 4 * n / r["seconds"] / 1e9
    return {"numel": n, "k": k, "torch": torch.__version__, "rows": rows}


def linear(device, small: bool) -> dict:
    """pyfast's fused linear_act (GEMM + bias + GELU in one kernel) against F.linear alone
    (cuBLAS: the GEMM-only bound) and F.linear then a separate GELU, bf16 on a GPU (fp32 on
    the CPU). Shapes (M, K, N): square, and output-heavy (N >> K: the epilogue's bytes weigh)."""
    from pyfast.ops.linear import linear_act
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(256, 128, 512), (128, 64, 1024)] if small else \
        [(8192, 4096, 4096), (8192, 1024, 16384), (16384, 512, 8192)]
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=dt)
        w = torch.randn(n, k, device=device, dtype=dt) / k ** 0.5
        bias = torch.randn(n, device=device, dtype=dt)
        with torch.no_grad():
            t_mm = timed(lambda: F.linear(x, w, bias), device)
            t_sep = timed(lambda: F.gelu(F.linear(x, w, bias)), device)
            t_fused = timed(lambda: linear_act(x, w, bias, "gelu"), device)
        flops = 2.0 * m * k * n
        rows.append({"M": m, "K": k, "N": n, "dtype": str(dt).split(".")[1],
                     "gemm_s": t_mm, "separate_s": t_sep, "fused_s": t_fused,
                     "fused_TFLOPS": flops / t_fused / 1e12, "gemm_TFLOPS": flops / t_mm / 1e12,
                     "vs_gemm": t_mm / t_fused, "vs_separate": t_sep / t_fused})
    return {"rows": rows}


def attention(device, small: bool) -> dict:
    """pyfast's block attention forward (the ring's per-block kernel: out + lse) against
    scaled_dot_product_attention (flash on a GPU), causal, head dim 128 (64 small), bf16 on a
    GPU. FLOPs: 4 B H S^2 D, halved for causal."""
    from pyfast.ops.attention import block_attention
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = [(1, 4, 256, 64)] if small else [(1, 32, 4096, 128), (1, 32, 8192, 128)]
    rows = []
    for b, h, s, d in cases:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt) for _ in range(3))
        with torch.no_grad():
            t_ours = timed(lambda: block_attention(q, k, v, causal=True), device)
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           device)
        flops = 4.0 * b * h * s * s * d / 2
        rows.append({"B": b, "H": h, "S": s, "D": d, "dtype": str(dt).split(".")[1],
                     "pyfast_s": t_ours, "sdpa_s": t_sdpa,
                     "pyfast_TFLOPS": flops / t_ours / 1e12, "sdpa_TFLOPS": flops / t_sdpa / 1e12,
                     "vs_sdpa": t_sdpa / t_ours})
    return {"rows": rows}


def overlap(device, small: bool) -> dict:
    """The native engine's int8 all-reduces of 4 buckets on a world of one (NCCL on a GPU,
    gloo on the CPU) queued, then a run of matmuls on the caller's stream: the matmuls' own
    time alone and while the all-reduces run beside them (their side stream / thread), and the
    all-reduces alone. compute_slowdown = with / alone - 1 (target <= 10%)."""
    import tempfile

    import torch.distributed as dist

    from pyfast.comm.engine import NativeEngine
    with tempfile.NamedTemporaryFile() as f:
        cuda = device.type == "cuda"
        if cuda and device.index is None:  # NCCL binds to one indexed device
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{f.name}",
                                rank=0, world_size=1, device_id=device if cuda else None)
        try:
            eng = NativeEngine.private()
            dt = torch.bfloat16 if device.type == "cuda" else torch.float32
            d, reps, n = (256, 8, 1 << 20) if small else (8192, 20, 1 << 24)
            a = torch.randn(d, d, device=device, dtype=dt)
            buckets = [torch.randn(n, device=device) for _ in range(4)]

            def matmuls():
                for _ in range(reps):
                    a @ a

            def reduces():
                return [eng.all_reduce(t, "int8", name=f"b{i}") for i, t in enumerate(buckets)]

            def both():  # the matmuls' own time while the all-reduces run beside them
                hs = reduces()
                if device.type == "cuda":
                    e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    e0.record()
                    matmuls()
                    e1.record()
                else:
                    t0 = time.perf_counter()
                    matmuls()
                    t1 = time.perf_counter()
                for h in hs:
                    h.wait()
                if device.type == "cuda":
                    e1.synchronize()
                    return e0.elapsed_time(e1) / 1e3
                return t1 - t0
            t_mm = timed(matmuls, device, flush=False)
            t_ar = timed(lambda: [h.wait() for h in reduces()], device, flush=False)
            both()
            t_with = statistics.median(both() for _ in range(REPEATS))
            eng.close()
        finally:
            dist.destroy_process_group()
    return {"matmul_s": t_mm, "allreduce_s": t_ar, "matmul_with_allreduce_s": t_with,
            "compute_slowdown": t_with / t_mm - 1, "bucket_numel": n, "buckets": len(buckets)}


PARTS = {"roof": roof, "quantize": quantize, "topk": topk, "linear": linear,
         "attention": attention, "overlap": overlap}
