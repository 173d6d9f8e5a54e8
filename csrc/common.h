// Helpers shared by the CPU kernels (csrc/quantize.cpp, csrc/topk.cpp); formats: docs/FORMATS.md.
//
// Everything here is written so GCC vectorizes the loops that call it (-O3 -march=native):
// no branches, only ternaries between values that are both computed anyway (GCC will not
// if-convert a branch holding an fp op that may trap, -ftrapping-math being the default),
// and bf16/fp16 conversions by integer/fp32 bit arithmetic (GCC 12 has no vector type for
// _Float16 without AVX512-FP16, so `(float)half` would stay scalar).
#pragma once

#include <ATen/Parallel.h>

#include "check.h"

#include <cstdint>
#include <cstring>

namespace pyfast {

// The per-element helpers must inline into the loops that call them, or those loops stay scalar
// (encode<fp8, stochastic>, called from two loops, was outlined once: 17x slower).
#define PYFAST_INLINE inline __attribute__((always_inline))

// Below 64K elements (256 KB of fp32, ~10 us of work) waking the OpenMP team costs more than
// the second core saves; above it, take torch's thread count so torch.set_num_threads(1) in a
// training rank is respected.
constexpr int64_t kSerialBelow = 1 << 16;
inline int threads_for(int64_t n) { return n < kSerialBelow ? 1 : at::get_num_threads(); }

// Parallel loops use static schedules: each thread streams one contiguous range. Handing out
// 64K-element tasks dynamically instead made quantize + dequantize_accumulate_ of 16M fp32 15%
// slower on an idle machine (3.5 vs 3.05 ms, 2 threads) and was no steadier with another
// process busy on one core.

PYFAST_INLINE uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
PYFAST_INLINE float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (y + M) - M is rne(y) for |y| < 2^22
PYFAST_INLINE float rne(float y) { return (y + kMagic) - kMagic; }  // -ffp-contract=off: no FMA

// Element types as stored: fp32, or the raw 16 bits of a bf16 / fp16.
struct Bf16 { uint16_t x; };
struct F16 { uint16_t x; };

PYFAST_INLINE float widen(float v) { return v; }
PYFAST_INLINE float widen(Bf16 v) { return u2f(uint32_t(v.x) << 16); }
// fp16 -> fp32, exact (the FP16 library's branch-free algorithm, as c10 without F16C).
PYFAST_INLINE float widen(F16 v) {
  const uint32_t w = uint32_t(v.x) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normal = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormal = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
  return u2f(sign | (two_w < (1u << 27) ? f2u(denormal) : f2u(normal)));
}

// fp32 -> T with one round-to-nearest-even, bitwise as torch's .to(dtype) for non-NaN values.
template <class T> PYFAST_INLINE T narrow(float v);
template <> PYFAST_INLINE float narrow<float>(float v) { return v; }
template <> PYFAST_INLINE Bf16 narrow<Bf16>(float v) {
  const uint32_t u = f2u(v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return Bf16{uint16_t(v != v ? 0x7FC0u : r)};  // NaN -> c10's quiet NaN
}
// fp16: the FP16 library's fp16_ieee_from_fp32_value (c10's without F16C), branch-free.
template <> PYFAST_INLINE F16 narrow<F16>(float v) {
  float base = (__builtin_fabsf(v) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f2u(v), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = u2f((bias >> 1) + 0x07800000u) + base;  // rounds the mantissa to 10 bits, RNE
  const uint32_t bits = f2u(base), nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return F16{uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

// u_i = (lowbias32((uint32)i + seed * 0x9E3779B9) >> 8) * 2^-24, in [0, 1);
// seed_mix = (uint32)seed * 0x9E3779B9.
PYFAST_INLINE float uniform(uint32_t i, uint32_t seed_mix) {
  uint32_t k = i + seed_mix;
  k ^= k >> 16; k *= 0x7FEB352Du; k ^= k >> 15; k *= 0x846CA68Bu; k ^= k >> 16;
  return float(int32_t(k >> 8)) * 0x1p-24f;  // both steps exact
}

// GCC 12 (default -ftrapping-math) will not if-convert an fp op that it has sunk under a
// condition, and it sinks or threads fp math behind fp comparisons, so a ternary over fp
// compares can leave a whole loop scalar. Below, choices are integer compares of bit patterns
// (ordered like the values for non-negative, non-NaN floats) or bit arithmetic.

// e4m3fn nearest-even code (0..0x7E) of a magnitude m in [0, 448] (not NaN).
PYFAST_INLINE uint32_t e4m3_encode(float m) {
  const uint32_t sub = uint32_t(int32_t(rne(m * 512.f)));  // m < 2^-6: 0..8
  uint32_t u = f2u(m);
  u += 0x7FFFFu + ((u >> 20) & 1u);
  uint32_t normal = (u >> 20) - (120u << 3);
  normal = normal > 0x7Eu ? 0x7Eu : normal;
  return f2u(m) < 0x3C800000u ? sub : normal;  // m < 2^-6
}

// Exact magnitude of code c (sign bit ignored): significand (8 + f, or f when e == 0) times
// 2^(max(e, 1) - 10), both picked by bit arithmetic.
PYFAST_INLINE float e4m3_decode(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xFu, f = c & 7u;
  const uint32_t sig = f | (((0u - e) >> 28) & 8u), ex = e | ((e - 1u) >> 31);
  return float(int32_t(sig)) * u2f((ex + 117u) << 23);
}

}  // namespace pyfast
