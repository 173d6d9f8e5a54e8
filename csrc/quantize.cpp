// CPU kernels for pyfast::quantize / dequantize / dequantize_accumulate_ (docs/FORMATS.md).
//
// One quant block per iteration of the parallel loop (static schedule, common.h).
// quantize reads a block twice, an amax pass then an encode pass, while it sits in L1/L2
// (512 fp32 = 2 KB by default). amax is a max over |x| bit patterns as integers: exact, NaN
// sorts above Inf so one compare finds a non-finite block, and an integer max vectorizes
// (GCC keeps an fp max loop scalar: with NaNs its result depends on the order).
//
// nf4 (frozen LoRA base weights): the code is a count of threshold compares, 15 per element,
// branch-free so the loop vectorizes; dequantize scales the 16-entry codebook once per block
// and then each nibble is a table lookup (see dequantize_block).
//
// Deliberate difference from FORMATS.md, kept because the tests compare bitwise with
// pyfast.ops.quantize.quantize_ref: `inv` is (1 / amax) * qmax, two roundings, because torch
// evaluates the reference's `qmax / amax` (python float / tensor) as reciprocal() * qmax.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string_view>

#include "common.h"
#include "format.h"

namespace pyfast {
namespace {

using format::codes_len;
using format::FP8;
using format::INT4;
using format::INT8;
using format::NF4;
using format::Quant;
using format::scales_len;
using format::SIGN;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ------------------------------------------------------------------ quantize
// Code of y = x * inv, element i (global index, for the hash) of a finite block: the byte for
// int8 / fp8, the nibble in the low 4 bits for int4 / nf4. y is not NaN (see quantize_block).
// Written without fp compares in conditions (common.h) so that all variants vectorize.
template <int K, bool STOCH>
PYFAST_INLINE uint32_t encode(float y, uint32_t i, uint32_t seed_mix) {
  if constexpr (K == NF4) {  // #{k : y > t_k}: the nearest codebook entry, ties to the smaller
    uint32_t c = 0;
    for (int k = 0; k < 15; ++k) c += uint32_t(y > format::kNF4Threshold[k]);
    return c;
  } else if constexpr (K == FP8) {
    const float m = u2f(std::min(f2u(y) & 0x7FFFFFFFu, f2u(format::qmax(FP8))));  // min(|y|, 448)
    uint32_t c = e4m3_encode(m);
    if constexpr (STOCH) {
      const float a = e4m3_decode(c);
      const uint32_t up = (f2u(a) - f2u(m)) >> 31;                  // a < m
      const uint32_t o = c + up - ((1u - up) & ((0u - c) >> 31));   // up ? c + 1 : max(c - 1, 0)
      const float b = e4m3_decode(o);
      // (m - a) / (b - a) with both signs dropped (same quotient); b == a only when m == a == 0,
      // where the max with the smallest denormal makes p = 0, as the reference's where().
      const float p = __builtin_fabsf(m - a) / u2f(std::max(f2u(__builtin_fabsf(b - a)), 1u));
      const uint32_t take = (f2u(uniform(i, seed_mix)) - f2u(p)) >> 31;  // u < p
      c ^= (c ^ o) & (0u - take);
    }
    return c | ((f2u(y) >> 24) & 0x80u & (0u - uint32_t(c != 0)));  // -0 encodes as 0x00
  } else {
    constexpr int32_t q = int32_t(format::qmax(Quant(K)));
    float r;
    if constexpr (STOCH) {  // floor(z) as rne(z) - (rne(z) > z): __builtin_floorf stays scalar
      const float z = y + uniform(i, seed_mix);
      r = rne(z);
      r = r > z ? r - 1.f : r;
    } else {
      r = rne(y);
    }
    // r is integral with |r| <= qmax + 1 here, so the int conversion is exact and the clamp is
    // an integer min/max: clamping in fp32 made GCC blend bytes through mask spills (1.5x slower).
    return uint32_t(std::min(std::max(int32_t(r), -q), q)) & (K == INT8 ? 0xFFu : 0xFu);
  }
}

template <class In>
void sign_block(const In* __restrict x, int64_t len, uint8_t* __restrict codes, float* scale) {
  // 16 independent fp32 partial sums (one AVX-512 register): a single running sum would be a
  // serial dependency GCC may not reorder (no -ffast-math). Order is backend-defined (FORMATS.md).
  float acc[16] = {};
  const int64_t full = len & ~int64_t(15);
  for (int64_t i = 0; i < full; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += __builtin_fabsf(widen(x[i + k]));
  for (int64_t i = full; i < len; ++i) acc[i - full] += __builtin_fabsf(widen(x[i]));
  for (int w = 8; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  const float mean = acc[0] / float(len);
  *scale = mean - mean == 0.f ? mean : kNaN;  // Inf - Inf and NaN - NaN are NaN
  const int64_t nfull = len / 8;
  for (int64_t j = 0; j < nfull; ++j) {
    uint32_t byte = 0;
    for (int k = 0; k < 8; ++k) byte |= uint32_t(widen(x[8 * j + k]) < 0.f) << k;
    codes[j] = uint8_t(byte);
  }
  if (len % 8) {
    uint32_t byte = 0;  // pad bits 0
    for (int64_t k = 0; k < len % 8; ++k) byte |= uint32_t(widen(x[8 * nfull + k]) < 0.f) << k;
    codes[nfull] = uint8_t(byte);
  }
}

template <class In, int K, bool STOCH>
void quantize_block(const In* __restrict x, int64_t start, int64_t len, uint32_t seed_mix,
                    uint8_t* __restrict codes, float* scale) {
  x += start;
  if constexpr (K == SIGN) {
    return sign_block(x, len, codes + start / 8, scale);
  } else {
    constexpr bool kNibbles = K == INT4 || K == NF4;
    uint8_t* c = codes + (kNibbles ? start / 2 : start);
    uint32_t amax_bits = 0;
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t a = f2u(widen(x[i])) & 0x7FFFFFFFu;
      amax_bits = a > amax_bits ? a : amax_bits;
    }
    if (amax_bits >= 0x7F800000u) {  // NaN or Inf: scale NaN, every code 0
      *scale = kNaN;
      std::memset(c, 0, codes_len(len, Quant(K)));
      return;
    }
    constexpr float qmax = format::qmax(Quant(K));
    const float amax = u2f(amax_bits);
    *scale = amax / qmax;
    const float inv = amax > 0.f ? (1.f / amax) * qmax : 0.f;  // see the file comment
    const uint32_t i0 = uint32_t(start);
    auto code = [&](float y, int64_t i) { return encode<K, STOCH>(y, i0 + uint32_t(i), seed_mix); };
    if (inv > std::numeric_limits<float>::max()) {
      // qmax / amax overflowed (amax < ~1e-36): y = x * inf is +-inf, or NaN for x = 0. Rare,
      // so a separate loop keeps these tests out of the vectorized ones. 0 encodes as 0, +-inf
      // as +-1e6 (the same codes, clamped to +-qmax, with a defined int conversion).
      std::memset(c, 0, codes_len(len, Quant(K)));
      for (int64_t i = 0; i < len; ++i) {
        const float v = widen(x[i]);
        const uint32_t q = code(v == 0.f ? 0.f : v < 0.f ? -1e6f : 1e6f, i);
        c[kNibbles ? i / 2 : i] |= uint8_t(kNibbles ? q << (4 * (i & 1)) : q);
      }
    } else if constexpr (kNibbles) {  // low nibble even i, high nibble odd i, pad nibble 0
      for (int64_t j = 0; j < len / 2; ++j)
        c[j] = uint8_t(code(widen(x[2 * j]) * inv, 2 * j) |
                       code(widen(x[2 * j + 1]) * inv, 2 * j + 1) << 4);
      if (len & 1) c[len / 2] = uint8_t(code(widen(x[len - 1]) * inv, len - 1));
    } else {
      for (int64_t i = 0; i < len; ++i) c[i] = uint8_t(code(widen(x[i]) * inv, i));
    }
  }
}

template <class In, int K, bool STOCH>
void quantize_all(const at::Tensor& x, int64_t B, uint32_t seed_mix, uint8_t* codes,
                  float* scales) {
  const In* p = reinterpret_cast<const In*>(x.const_data_ptr());
  const int64_t n = x.numel(), nb = scales_len(n, B);
  const int nt = threads_for(n);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t b = 0; b < nb; ++b)
    quantize_block<In, K, STOCH>(p, b * B, std::min(B, n - b * B), seed_mix, codes, scales + b);
}

template <class In, bool ST>
void quantize_dispatch(const at::Tensor& x, Quant k, int64_t B, uint32_t sm, uint8_t* c, float* s) {
  switch (k) {
    case INT8: return quantize_all<In, INT8, ST>(x, B, sm, c, s);
    case INT4: return quantize_all<In, INT4, ST>(x, B, sm, c, s);
    case FP8: return quantize_all<In, FP8, ST>(x, B, sm, c, s);
    case SIGN: return quantize_all<In, SIGN, false>(x, B, sm, c, s);  // never stochastic
    case NF4: return quantize_all<In, NF4, false>(x, B, sm, c, s);    // never stochastic
  }
}

template <class In>
void quantize_dispatch(const at::Tensor& x, Quant k, int64_t B, bool st, uint32_t sm, uint8_t* c,
                       float* s) {
  if (st) quantize_dispatch<In, true>(x, k, B, sm, c, s);
  else quantize_dispatch<In, false>(x, k, B, sm, c, s);
}

std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x_in, std::string_view kind,
                                                int64_t block, bool stochastic, int64_t seed) {
  const Quant k = format::parse(kind);
  format::check_block(block);
  PYFAST_CHECK(!(stochastic && k == SIGN),
              "sign has no stochastic rounding: its codes are exact signs");
  PYFAST_CHECK(!(stochastic && k == NF4),
              "nf4 has no stochastic rounding: it quantizes a frozen weight once, to the nearest "
              "codebook entry");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel(), nb = scales_len(n, block);
  at::Tensor codes = at::empty({codes_len(n, k)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nb}, x.options().dtype(at::kFloat));
  if (n == 0) return {codes, scales};
  const uint32_t sm = uint32_t(seed) * 0x9E3779B9u;
  uint8_t* c = codes.mutable_data_ptr<uint8_t>();
  float* s = scales.mutable_data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: quantize_dispatch<float>(x, k, block, stochastic, sm, c, s); break;
    case at::kBFloat16: quantize_dispatch<Bf16>(x, k, block, stochastic, sm, c, s); break;
    case at::kHalf: quantize_dispatch<F16>(x, k, block, stochastic, sm, c, s); break;
    default:
      PYFAST_CHECK(false, "quantize takes float32, bfloat16 or float16 tensors, got ",
                  x.scalar_type());
  }
  return {codes, scales};
}

// ------------------------------------------------------------------ dequantize
template <bool ACC, class Out>
PYFAST_INLINE void put(Out& o, float v) {
  if constexpr (ACC) o += v;  // Out is float
  else o = narrow<Out>(v);
}

template <int K, class Out, bool ACC>
void dequantize_block(const uint8_t* __restrict codes, float s, int64_t start, int64_t len,
                      Out* __restrict out) {
  out += start;
  if constexpr (K == INT8 || K == FP8) {
    const uint8_t* c = codes + start;
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t b = c[i];
      const float v = K == INT8 ? float(int8_t(b)) : u2f(f2u(e4m3_decode(b)) | (b & 0x80u) << 24);
      put<ACC>(out[i], v * s);
    }
  } else if constexpr (K == INT4) {
    const uint8_t* c = codes + start / 2;
    const int64_t np = len / 2;
    for (int64_t j = 0; j < np; ++j) {
      const int8_t b = int8_t(c[j]);
      put<ACC>(out[2 * j], float(int8_t(b << 4) >> 4) * s);  // sign-extended low nibble
      put<ACC>(out[2 * j + 1], float(b >> 4) * s);
    }
    if (len & 1) put<ACC>(out[len - 1], float(int8_t(c[np] << 4) >> 4) * s);
  } else if constexpr (K == NF4) {
    // The block's 16 values kNF4[c] * s (the same fp32 products as per element), narrowed
    // once; then every nibble is a scalar lookup. Single-threaded this runs at memcpy speed
    // (16M elements to fp32, block 64: 23-41 ms vs memcpy 25-33 ms, shared 2-core Xeon), and an
    // AVX-512 permutexvar version was no faster there (18-37 ms): memory-bound, kept scalar.
    // Whole-op numbers: bench/results/nf4_ops.txt.
    float lut[16];
    for (int k = 0; k < 16; ++k) lut[k] = format::kNF4[k] * s;
    const uint8_t* c = codes + start / 2;
    const int64_t np = len / 2;
    if constexpr (ACC) {
      for (int64_t j = 0; j < np; ++j) {
        out[2 * j] += lut[c[j] & 0xF];
        out[2 * j + 1] += lut[c[j] >> 4];
      }
      if (len & 1) out[len - 1] += lut[c[np] & 0xF];
    } else {
      Out nlut[16];
      for (int k = 0; k < 16; ++k) nlut[k] = narrow<Out>(lut[k]);
      for (int64_t j = 0; j < np; ++j) {
        out[2 * j] = nlut[c[j] & 0xF];
        out[2 * j + 1] = nlut[c[j] >> 4];
      }
      if (len & 1) out[len - 1] = nlut[c[np] & 0xF];
    }
  } else {  // sign: bit ? -scale : +scale, a sign flip of the scale's bits
    const uint8_t* c = codes + start / 8;
    const uint32_t sb = f2u(s);
    const int64_t nfull = len / 8;
    auto value = [&](uint32_t byte, int k) { return u2f(sb ^ ((byte >> k & 1u) << 31)); };
    for (int64_t j = 0; j < nfull; ++j)
      for (int k = 0; k < 8; ++k) put<ACC>(out[8 * j + k], value(c[j], k));
    for (int k = 0; k < len % 8; ++k) put<ACC>(out[8 * nfull + k], value(c[nfull], k));
  }
}

template <int K, class Out, bool ACC>
void dequantize_all(const uint8_t* codes, const float* scales, int64_t n, int64_t B, Out* out) {
  const int64_t nb = scales_len(n, B);
  const int nt = threads_for(n);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t b = 0; b < nb; ++b)
    dequantize_block<K, Out, ACC>(codes, scales[b], b * B, std::min(B, n - b * B), out);
}

template <class Out, bool ACC>
void dequantize_dispatch(Quant k, const uint8_t* c, const float* s, int64_t n, int64_t B,
                         void* out) {
  Out* o = static_cast<Out*>(out);
  switch (k) {
    case INT8: return dequantize_all<INT8, Out, ACC>(c, s, n, B, o);
    case INT4: return dequantize_all<INT4, Out, ACC>(c, s, n, B, o);
    case FP8: return dequantize_all<FP8, Out, ACC>(c, s, n, B, o);
    case SIGN: return dequantize_all<SIGN, Out, ACC>(c, s, n, B, o);
    case NF4: return dequantize_all<NF4, Out, ACC>(c, s, n, B, o);
  }
}

at::Tensor dequantize_cpu(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t n,
                          std::string_view kind, int64_t block, at::ScalarType dtype) {
  const Quant k = format::parse(kind);
  format::check_block(block);
  format::check_layout(codes_in, scales_in, n, k, block);
  PYFAST_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dequantize writes float32, bfloat16 or float16, not ", dtype);
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor out = at::empty({n}, codes.options().dtype(dtype));
  if (n == 0) return out;
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const float* s = scales.const_data_ptr<float>();
  void* o = out.mutable_data_ptr();
  if (dtype == at::kFloat) dequantize_dispatch<float, false>(k, c, s, n, block, o);
  else if (dtype == at::kBFloat16) dequantize_dispatch<Bf16, false>(k, c, s, n, block, o);
  else dequantize_dispatch<F16, false>(k, c, s, n, block, o);
  return out;
}

void dequantize_accumulate_cpu(const at::Tensor& out, const at::Tensor& codes_in,
                               const at::Tensor& scales_in, std::string_view kind, int64_t block) {
  const Quant k = format::parse(kind);
  format::check_block(block);
  PYFAST_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(),
              "accumulate buffer must be contiguous float32, got ", out.scalar_type());
  const int64_t n = out.numel();
  format::check_layout(codes_in, scales_in, n, k, block);
  if (n == 0) return;
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  dequantize_dispatch<float, true>(k, codes.const_data_ptr<uint8_t>(),
                                   scales.const_data_ptr<float>(), n, block,
                                   out.mutable_data_ptr());
}

}  // namespace
}  // namespace pyfast

TORCH_LIBRARY_IMPL(pyfast, CPU, m) {
  m.impl("quantize", &pyfast::quantize_cpu);
  m.impl("dequantize", &pyfast::dequantize_cpu);
  m.impl("dequantize_accumulate_", &pyfast::dequantize_accumulate_cpu);
}
