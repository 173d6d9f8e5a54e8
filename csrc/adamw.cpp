// CPU kernel for pyfast::adamw_: torch.optim.AdamW's step over lists of tensors, one fused pass.
// Reference: pyfast/ops/adamw.py (adamw_reference_, torch ops in torch's single-tensor order).
//
// Per element, in fp32 (scalars computed in double as Python does, then rounded to fp32 as
// torch's kernels round a Python scalar):
//   g  = grad * grad_scale                      (a clip coefficient or 1/loss-scale, folded in)
//   p *= 1 - lr * wd                            (decoupled weight decay)
//   m  = lerp(m, g, 1 - beta1)                  (torch's lerp: fma(w, g - m, m) for w < 0.5)
//   v  = fma((1 - beta2) * g, g, v * beta2)     (mul_ then addcmul_, whose vector path fuses)
//   p += (-lr / bc1 * m) / (sqrt(v) / sqrt(bc2) + eps),  bc_k = 1 - beta_k^step
// Parameters are fp32 or bf16 (computed in fp32, one round-to-nearest-even on store, as
// torch's .to(bfloat16)); gradients the parameter's dtype or fp32; moments fp32.
//
// One pass reads p, g, m, v and writes p, m, v: 28 bytes per fp32 parameter, the memory roof
// (bench/results/adamw.txt). torch's foreach AdamW makes ~8 passes over the same tensors.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "common.h"

namespace pyfast {
namespace {

// 64K elements (1 MB over p, g, m, v in fp32) a chunk: the unit the threads split. Smaller
// chunks only add bookkeeping; larger ones leave a ragged last chunk of a tensor unbalanced.
constexpr int64_t kChunk = 1 << 16;

struct Coef {
  float decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps, gs;
  bool small;  // torch's lerp: weight < 0.5 -> m + w (g - m), else g - (g - m)(1 - w)
};

// Vectorizes (8 wide, AVX2) only under setup.py's -fno-math-errno: with errno semantics GCC
// keeps sqrtf a scalar call, and the whole loop scalar with it.
template <class P, class G>
void update(P* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
            int64_t n, const Coef c) {
  const float coeff = c.small ? c.w1 : c.w1 - 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = widen(g[i]) * c.gs;
    const float pi = widen(p[i]) * c.decay;
    const float mo = m[i];
    const float mi = std::fma(coeff, gi - mo, c.small ? mo : gi);  // torch's lerp_vec: fmadd
    const float vi = std::fma(c.w2 * gi, gi, v[i] * c.beta2);  // torch's addcmul vector path
    const float den = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = narrow<P>(pi + (c.neg_step_size * mi) / den);
  }
}

struct Chunk { int64_t tensor, begin, len; };

void run_chunk(const Chunk& k, const at::TensorList params, const at::TensorList grads,
               const at::TensorList ms, const at::TensorList vs, const Coef& c) {
  const at::Tensor &p = params[k.tensor], &g = grads[k.tensor];
  float* m = ms[k.tensor].data_ptr<float>() + k.begin;
  float* v = vs[k.tensor].data_ptr<float>() + k.begin;
  const bool gf = g.scalar_type() == at::kFloat;
  if (p.scalar_type() == at::kFloat) {
    update(p.data_ptr<float>() + k.begin, g.data_ptr<float>() + k.begin, m, v, k.len, c);
  } else {
    Bf16* pb = reinterpret_cast<Bf16*>(p.data_ptr()) + k.begin;
    if (gf) update(pb, g.data_ptr<float>() + k.begin, m, v, k.len, c);
    else update(pb, reinterpret_cast<const Bf16*>(g.data_ptr()) + k.begin, m, v, k.len, c);
  }
}

void check_list(const at::TensorList ts, const char* name, int64_t i, const at::Tensor& p) {
  const at::Tensor& t = ts[i];
  PYFAST_CHECK(t.device().is_cpu(), "adamw_: ", name, "[", i, "] is on ", t.device(),
               "; this kernel takes CPU tensors");
  PYFAST_CHECK(t.is_contiguous(), "adamw_: ", name, "[", i, "] (sizes ", t.sizes(),
               ") is not contiguous");
  PYFAST_CHECK(t.numel() == p.numel(), "adamw_: ", name, "[", i, "] has ", t.numel(),
               " elements but params[", i, "] has ", p.numel());
}

void adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, const std::optional<at::Tensor>& grad_scale_t,
               double grad_scale) {
  const int64_t n = params.size();
  PYFAST_CHECK(grads.size() == size_t(n) && exp_avgs.size() == size_t(n) &&
                   exp_avg_sqs.size() == size_t(n),
               "adamw_: the four lists must have one tensor per parameter; got ", n,
               " params, ", grads.size(), " grads, ", exp_avgs.size(), " exp_avgs, ",
               exp_avg_sqs.size(), " exp_avg_sqs");
  PYFAST_CHECK(step >= 1, "adamw_: step counts from 1 (the bias correction divides by ",
               "1 - beta^step), got ", step);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list(params, "params", i, p);
    check_list(grads, "grads", i, p);
    check_list(exp_avgs, "exp_avgs", i, p);
    check_list(exp_avg_sqs, "exp_avg_sqs", i, p);
    const auto pt = p.scalar_type(), gt = grads[i].scalar_type();
    PYFAST_CHECK(pt == at::kFloat || pt == at::kBFloat16, "adamw_: params[", i,
                 "] is ", pt, "; the kernel takes float32 or bfloat16 parameters");
    PYFAST_CHECK(gt == pt || gt == at::kFloat, "adamw_: grads[", i, "] is ", gt,
                 "; gradients must be the parameter's dtype (", pt, ") or float32");
    PYFAST_CHECK(exp_avgs[i].scalar_type() == at::kFloat &&
                     exp_avg_sqs[i].scalar_type() == at::kFloat,
                 "adamw_: exp_avgs[", i, "] and exp_avg_sqs[", i, "] must be float32, got ",
                 exp_avgs[i].scalar_type(), " and ", exp_avg_sqs[i].scalar_type());
  }
  double gs = grad_scale;
  if (grad_scale_t.has_value()) {
    const at::Tensor& t = *grad_scale_t;
    PYFAST_CHECK(t.numel() == 1 && t.device().is_cpu() && t.is_floating_point(),
                 "adamw_: grad_scale_t must be a one-element floating CPU tensor, got ",
                 t.numel(), " elements of ", t.scalar_type(), " on ", t.device());
    gs *= t.item<double>();
  }
  // Python's order: 1 - beta ** step and bc2 ** 0.5 in double; each scalar then rounds to fp32
  // as torch's kernels take a Python float for an fp32 tensor.
  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  const double w1 = 1.0 - beta1;
  const Coef c{float(1.0 - lr * weight_decay), float(w1), float(beta2), float(1.0 - beta2),
               float(-(lr / bc1)), float(std::pow(bc2, 0.5)), float(eps), float(gs),
               std::fabs(float(w1)) < 0.5f};

  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = params[i].numel();
    total += len;
    for (int64_t b = 0; b < len; b += kChunk) chunks.push_back({i, b, std::min(kChunk, len - b)});
  }
  const int64_t nc = chunks.size();
  // a grain of all chunks runs serially: below kSerialBelow waking the team costs more
  at::parallel_for(0, nc, total < kSerialBelow ? std::max<int64_t>(nc, 1) : 1,
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t k = lo; k < hi; ++k)
                       run_chunk(chunks[k], params, grads, exp_avgs, exp_avg_sqs, c);
                   });
}

}  // namespace
}  // namespace pyfast

TORCH_LIBRARY_IMPL(pyfast, CPU, m) { m.impl("adamw_", &pyfast::adamw_cpu); }
