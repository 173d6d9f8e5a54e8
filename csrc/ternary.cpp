// CPU kernels for pyfast::ternary_encode / ternary_decode: TernGrad (Wen et al., NeurIPS 2017).
// Reference: pyfast/ops/ternary.py (`*_ref`), bit for bit.
//
// Per block of B elements (B a multiple of 4): s = max |x| in fp32 (NaN if the block holds a
// NaN or an Inf); element i codes to sign(x_i) when u_i < |x_i| / s, else to 0, with u_i the
// shared counter-based uniform of common.h (the stochastic quantizers' hash; seed_mix =
// (uint32)seed * 0x9E3779B9, i the element's index in x). Codes: 0 -> 0, +1 -> 1, -1 -> 2,
// four per byte, element 4j + k in bits 2k..2k+1 of byte j. Decode: y_i = c_i * s in fp32
// (so a NaN scale decodes to NaN throughout), then one rounding to the output dtype.
//
// The schemas live here (a TORCH_LIBRARY_FRAGMENT), not in module.cpp: a compressor is one
// kernel file plus its Python side.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common.h"

namespace pyfast {
namespace {

template <class In>
void encode_block(const In* x, int64_t start, int64_t len, uint32_t seed_mix, uint8_t* codes,
                  float* scale) {
  float s = 0.f;
  bool bad = false;
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(widen(x[start + i]));
    bad |= !std::isfinite(a);
    s = a > s ? a : s;
  }
  if (bad) s = NAN;
  *scale = s;
  // len is a multiple of 4 except in the last block; start is a multiple of 4
  for (int64_t j = 0; j < (len + 3) / 4; ++j) {
    uint32_t byte = 0;
    for (int64_t k = 0; k < 4 && 4 * j + k < len; ++k) {
      const int64_t i = start + 4 * j + k;
      const float v = widen(x[i]);
      const float p = std::fabs(v) / s;
      const bool take = uniform(uint32_t(i), seed_mix) < p;
      const uint32_t c = take ? (v < 0.f ? 2u : 1u) : 0u;
      byte |= c << (2 * k);
    }
    codes[start / 4 + j] = uint8_t(byte);
  }
}

template <class In>
void encode_all(const at::Tensor& x, int64_t B, uint32_t seed_mix, uint8_t* codes, float* scales) {
  const In* p = reinterpret_cast<const In*>(x.data_ptr());
  const int64_t n = x.numel(), nb = (n + B - 1) / B;
  at::parallel_for(0, nb, std::max<int64_t>(1, kSerialBelow / B), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      encode_block<In>(p, b * B, std::min(B, n - b * B), seed_mix, codes, scales + b);
  });
}

void check_block(int64_t block) {
  PYFAST_CHECK(block >= 4 && block % 4 == 0, "ternary: block must be a positive multiple of 4, got ",
              block);
}

std::tuple<at::Tensor, at::Tensor> ternary_encode_cpu(const at::Tensor& x_in, int64_t block,
                                                      int64_t seed) {
  check_block(block);
  const auto dt = x_in.scalar_type();
  PYFAST_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "ternary: takes float32, bfloat16 or float16 tensors, got ", dt);
  const at::Tensor x = x_in.contiguous().view(-1);
  const int64_t n = x.numel();
  auto codes = at::empty({(n + 3) / 4}, x.options().dtype(at::kByte));
  auto scales = at::empty({(n + block - 1) / block}, x.options().dtype(at::kFloat));
  const uint32_t sm = uint32_t(seed) * 0x9E3779B9u;
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  if (dt == at::kFloat) encode_all<float>(x, block, sm, c, s);
  else if (dt == at::kBFloat16) encode_all<Bf16>(x, block, sm, c, s);
  else encode_all<F16>(x, block, sm, c, s);
  return {codes, scales};
}

template <class Out>
void decode_all(const uint8_t* codes, const float* scales, int64_t n, int64_t B, Out* y) {
  at::parallel_for(0, n, kSerialBelow, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t c = (codes[i >> 2] >> (2 * (i & 3))) & 3u;
      const float sign = c == 1u ? 1.f : (c == 2u ? -1.f : 0.f);
      y[i] = narrow<Out>(sign * scales[i / B]);
    }
  });
}

at::Tensor ternary_decode_cpu(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t n,
                              int64_t block, at::ScalarType dtype) {
  check_block(block);
  PYFAST_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ternary: decodes to float32, bfloat16 or float16, got ", dtype);
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  PYFAST_CHECK(codes.scalar_type() == at::kByte && codes.numel() == (n + 3) / 4,
              "ternary: codes must be uint8[", (n + 3) / 4, "]");
  PYFAST_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == (n + block - 1) / block,
              "ternary: scales must be float32[", (n + block - 1) / block, "]");
  auto y = at::empty({n}, codes.options().dtype(dtype));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  if (dtype == at::kFloat) decode_all<float>(c, s, n, block, y.data_ptr<float>());
  else if (dtype == at::kBFloat16) decode_all<Bf16>(c, s, n, block, reinterpret_cast<Bf16*>(y.data_ptr()));
  else decode_all<F16>(c, s, n, block, reinterpret_cast<F16*>(y.data_ptr()));
  return y;
}

}  // namespace
}  // namespace pyfast

TORCH_LIBRARY_FRAGMENT(pyfast, m) {
  m.def("ternary_encode(Tensor x, int block, int seed) -> (Tensor, Tensor)");
  m.def("ternary_decode(Tensor codes, Tensor scales, int n, int block, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pyfast, CPU, m) {
  m.impl("ternary_encode", &pyfast::ternary_encode_cpu);
  m.impl("ternary_decode", &pyfast::ternary_decode_cpu);
}
