"""Does a fused C++ bias+GELU epilogue pay on CPU next to torch's GEMM (MKL)? Decides the CPU path
of pyfast.ops.linear.linear_act. Writes bench/results/epilogue.{txt,json}.

    pyfast bench epilogue [--repeats 21] [--out bench/results/epilogue]

The TP benchmark's MLP GEMMs (2048 tokens, 1024 -> 4096 with GELU, 4096 -> 1024 without), fp32,
one thread. Forward variants: (a) addmm + F.gelu, (b) matmul + bias add + F.gelu, (c) mm + a
fused C++ bias+GELU epilogue (OpenMP, ATen's Vectorized erf at torch's own CPU capability, one
in-place pass), (d) F.linear + F.gelu, and the bare mm as the GEMM floor; "epilogue" is a
variant's time over that floor. Then the layer's forward+backward (dx, dW, db) through torch's
autograd against an autograd Function that uses the fused epilogues in both directions (forward:
z += b and y = gelu(z) in one pass; backward: dz = dy * gelu'(z) and db = colsum(dz) in one
pass). Those end-to-end numbers differ by less than their noise, so the decision also looks at
the epilogues timed alone on a ready pre-activation (torch's: addmm's bias write + gelu,
gelu_backward + sum(0); fused: the two C++ passes), saved time over the torch layer's
forward+backward; the verdict takes the larger of the two savings.
Variants run round-robin inside each repeat, so load from other processes on this shared
machine hits them alike.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from pyfast import perf

SHAPES = [("fc1 gelu", 2048, 1024, 4096, True), ("fc2", 2048, 4096, 1024, False)]  # M, K, N
THRESHOLD = 0.03  # a fused epilogue must save this much of the layer's forward+backward

CPP = r"""
#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <cmath>
using Vec = at::vec::Vectorized<float>;
constexpr float kAlpha = M_SQRT1_2, kBeta = 0.3989422804014327f;  // 1/sqrt(2), 1/sqrt(2 pi)

static inline Vec gelu(Vec z) { return z * Vec(0.5f) * (Vec(1.f) + (z * Vec(kAlpha)).erf()); }
static inline float gelu(float z) { return 0.5f * z * (1.f + std::erf(z * kAlpha)); }

static void check(const torch::Tensor& t, int64_t n) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat && t.size(-1) == n);
}

// z[i, :] += b; y[i, :] = act(z[i, :]) in one pass (y may alias z: inference, in place)
void bias_act_(torch::Tensor z, torch::Tensor y, torch::Tensor b, bool act) {
  const int64_t M = z.size(0), N = z.size(1);
  check(z, N); check(y, N); check(b, N);
  float* zp = z.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  #pragma omp parallel for
  for (int64_t i = 0; i < M; ++i) {
    float* zr = zp + i * N; float* yr = yp + i * N;
    int64_t j = 0;
    for (; j + Vec::size() <= N; j += Vec::size()) {
      Vec v = Vec::loadu(zr + j) + Vec::loadu(bp + j);
      if (zr != yr) v.store(zr + j);
      (act ? gelu(v) : v).store(yr + j);
    }
    for (; j < N; ++j) { float v = zr[j] + bp[j]; zr[j] = v; yr[j] = act ? gelu(v) : v; }
  }
}

// dz = dy * gelu'(z) (torch's GeluBackward formula) and db = column sum of dz, one pass
std::vector<torch::Tensor> gelu_backward_db(torch::Tensor dy, torch::Tensor z) {
  const int64_t M = z.size(0), N = z.size(1);
  check(dy, N); check(z, N);
  auto dz = torch::empty_like(dy);
  auto part = torch::zeros({omp_get_max_threads(), N}, dy.options());
  const float* gp = dy.data_ptr<float>(); const float* zp = z.data_ptr<float>();
  float* dp = dz.data_ptr<float>(); float* pp = part.data_ptr<float>();
  #pragma omp parallel
  {
    float* acc = pp + omp_get_thread_num() * N;
    #pragma omp for
    for (int64_t i = 0; i < M; ++i) {
      int64_t j = 0, o = i * N;
      for (; j + Vec::size() <= N; j += Vec::size()) {
        Vec x = Vec::loadu(zp + o + j);
        Vec cdf = Vec(0.5f) * (Vec(1.f) + (x * Vec(kAlpha)).erf());
        Vec pdf = (Vec(-0.5f) * x * x).exp() * Vec(kBeta);
        Vec d = Vec::loadu(gp + o + j) * (cdf + x * pdf);
        d.store(dp + o + j);
        (Vec::loadu(acc + j) + d).store(acc + j);
      }
      for (; j < N; ++j) {
        float x = zp[o + j];
        float cdf = 0.5f * (1.f + std::erf(x * kAlpha)), pdf = std::exp(-0.5f * x * x) * kBeta;
        float d = gp[o + j] * (cdf + x * pdf);
        dp[o + j] = d; acc[j] += d;
      }
    }
  }
  return {dz, part.sum(0)};
}

int64_t omp_threads() { return omp_get_max_threads(); }
"""


def build():
    cap = torch.backends.cpu.get_cpu_capability()  # same vector width as torch's own kernels
    flags = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
    if cap in ("AVX2", "AVX512"):
        flags.append(f"-DCPU_CAPABILITY_{cap}")
    # the loaded .so stays mapped after its directory is removed (ignore: Windows refuses)
    with tempfile.TemporaryDirectory(prefix="pyfast_epilogue_", ignore_cleanup_errors=True) as d:
        return load_inline("pyfast_epilogue_bench", CPP, functions=["bias_act_",
                           "gelu_backward_db", "omp_threads"], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=d)


def fused_layer(ext):
    class FusedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, act):
            z = torch.mm(x, w.t())
            y = torch.empty_like(z) if act else z
            ext.bias_act_(z, y, b, act)
            ctx.save_for_backward(x, w, z if act else None)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, z = ctx.saved_tensors
            dy = dy.contiguous()
            dz, db = ext.gelu_backward_db(dy, z) if z is not None else (dy, dy.sum(0))
            return dz.mm(w), x.t().mm(dz).t(), db, None  # the GEMMs torch's AddmmBackward runs
    return FusedLinear.apply


def round_robin(fns: dict, repeats: int, device=None) -> dict:
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = perf.clock(device)
            f()
            times[k].append(perf.clock(device) - t0)
    return {k: perf.summary(ts) for k, ts in times.items()}


def measure(ext, name, m, k, n, act, repeats):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    gelu = F.gelu if act else (lambda t: t)  # noqa: E731
    wt = w.t()

    def fused_fwd():
        y = torch.mm(x, wt)
        ext.bias_act_(y, y, b, act)
        return y
    fwd = {"mm (GEMM floor)": lambda: torch.mm(x, wt),
           "(a) addmm + gelu": lambda: gelu(torch.addmm(b, x, wt)),
           "(b) matmul + add + gelu": lambda: gelu(torch.matmul(x, wt) + b),
           "(c) mm + fused C++": fused_fwd,
           "(d) linear + gelu": lambda: gelu(F.linear(x, w, b))}
    ref = fwd["(a) addmm + gelu"]()
    for key in ("(b) matmul + add + gelu", "(c) mm + fused C++", "(d) linear + gelu"):
        torch.testing.assert_close(fwd[key](), ref, rtol=1e-5, atol=1e-5)

    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    fused = fused_layer(ext)
    layer = {"torch: addmm + gelu, autograd":
             lambda: gelu(torch.addmm(bg, xg, wg.t())).backward(dy),
             "fused C++ epilogues fwd + bwd": lambda: fused(xg, wg, bg, act).backward(dy)}
    grads = []
    for f in layer.values():
        f()
        grads.append([t.grad.clone() for t in (xg, wg, bg)])
        for t in (xg, wg, bg):
            t.grad = None
    for a, r in zip(*grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)

    # the epilogues alone, on a ready pre-activation: small, stable numbers instead of the
    # difference of two noisy GEMM timings. Each side allocates what it allocates in the layer:
    # torch's forward epilogue is addmm's broadcast write of b into its output (the GEMM then
    # reads it back, not counted here) + F.gelu into a new y; the fused one writes z + b back
    # and gelu into a new y (training keeps z for the backward; no new y without activation)
    z = torch.mm(x, wt)
    zs, buf = z.clone(), torch.empty_like(z)
    epi = {"epilogue fwd: torch (addmm's bias write, gelu)":
           lambda: (buf.copy_(b.expand(m, n)), gelu(z)),
           "epilogue fwd: fused C++ (z += b, y = gelu(z))":
           lambda: ext.bias_act_(zs, torch.empty_like(zs) if act else zs, b, act)}
    if act:
        epi.update({"epilogue bwd: torch gelu_backward, sum(0)":
                    lambda: torch.ops.aten.gelu_backward(dy, z).sum(0),
                    "epilogue bwd: fused C++ gelu' + column sum":
                    lambda: ext.gelu_backward_db(dy, z)})

    def zero_grads():
        for t in (xg, wg, bg):
            t.grad = None
    steps = {k: (lambda f=f: (f(), zero_grads())) for k, f in layer.items()}
    timed = round_robin({**fwd, **epi, **steps}, repeats, device=dy.device)
    floor = timed["mm (GEMM floor)"]["median_s"]
    rows = []
    for key in fwd:
        t = timed[key]["median_s"]
        rows.append({"shape": name, "variant": key, **timed[key], "epilogue_s": t - floor,
                     "epilogue_frac": (t - floor) / t})
    rows += [{"shape": name, "variant": k, **timed[k]} for k in (*epi, *layer)]
    base, fast = (timed[k]["median_s"] for k in layer)
    e = [timed[k]["median_s"] for k in epi] + [0.0, 0.0]
    saved = (e[0] - e[1]) + (e[2] - e[3])  # fused epilogue time saved, forward + backward
    return rows, {"shape": name, "torch_s": base, "fused_s": fast, "saved_s": saved,
                  "saving": saved / base, "measured_saving": (base - fast) / base}


def table(result: dict):
    from rich.table import Table
    t = Table(title=f"Linear (+GELU) epilogue on CPU, fp32, {result['threads']} thread, "
                    f"median of {result['repeats']} round-robin repeats (q10-q90)\n"
                    f"{result['machine']}, 1-min load average {result['load'][0]:.1f} at start, "
                    f"{result['load'][1]:.1f} at end")
    perf.columns(t, ("shape (M x K -> N)", "variant", "ms", "q10-q90 ms", "epilogue ms",
                     "epilogue % of variant"), left=("shape (M x K -> N)", "variant"))
    for r in result["rows"]:
        ep = "epilogue_s" in r and r["variant"] != "mm (GEMM floor)"
        med, q10, q90 = (perf.stat(r, k) for k in perf.KEYS)  # also results before median_s
        t.add_row(r["shape"], r["variant"], f"{med * 1e3:.1f}", f"{q10 * 1e3:.1f}-{q90 * 1e3:.1f}",
                  f"{r['epilogue_s'] * 1e3:.1f}" if ep else "",
                  f"{100 * r['epilogue_frac']:.1f}%" if ep else "")
    for s in result["layers"]:
        t.add_row(s["shape"], "saving: epilogues alone / torch fwd+bwd",
                  f"{s['saved_s'] * 1e3:.1f}", "", "", f"{100 * s['saving']:.1f}%")
        t.add_row(s["shape"], "saving: end to end (noisy)",
                  f"{(s['torch_s'] - s['fused_s']) * 1e3:.1f}", "", "",
                  f"{100 * s['measured_saving']:.1f}%")
    t.caption = result["conclusion"]
    return t


def run(repeats: int = 21) -> dict:
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    ext = build()
    assert ext.omp_threads() == 1, "the extension must share torch's OpenMP runtime"
    rows, layers = [], []
    for name, m, k, n, act in SHAPES:
        r, s = measure(ext, f"{name} ({m} x {k} -> {n})", m, k, n, act, repeats)
        rows += r
        layers.append(s)
    load.append(os.getloadavg()[0])
    best = max(max(s["saving"], s["measured_saving"]) for s in layers)
    verdict = ("keep torch's GEMM + epilogue on CPU" if best < THRESHOLD else
               "a fused C++ epilogue pays: ask for it in csrc")
    result = {"machine": perf.machine(), "load": load, "threads": torch.get_num_threads(),
              "repeats": repeats, "rows": rows, "layers": layers, "threshold": THRESHOLD,
              "conclusion": f"largest fwd+bwd saving of the fused epilogues {100 * best:.1f}% vs "
                            f"the {100 * THRESHOLD:.0f}% bar: {verdict}"}
    return result


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="pyfast bench epilogue", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return perf.finish(run(a.repeats), table, a.out, width=150)


if __name__ == "__main__":
    sys.exit(main())
