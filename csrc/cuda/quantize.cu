// CUDA kernels for pyfast::quantize / dequantize / dequantize_accumulate_ (docs/FORMATS.md).
//
// quantize: one thread block per quant block. Each thread loads 4-element chunks (16 B for
// fp32, 8 B for bf16/fp16, so a warp reads 512 / 256 contiguous bytes per load), the block
// reduces amax (or sum |x| for sign) with warp shuffles, then quantizes its chunks again --
// from registers when the block is small enough (B <= 4096), else re-read (L1/L2 hits).
// Every rounding step is an explicit __f*_rn intrinsic: no FMA contraction may change a code,
// whatever --fmad says, because codes must equal the torch and Triton ones bit for bit.
// dequantize(_accumulate_): grid-stride, 4 elements per thread, one scale per chunk (B % 4 == 0).
// nf4: the code is 15 compares with thresholds in constant memory (the same address for every
// lane); the codebook is copied to shared memory per thread block, since per-lane indices into
// constant memory would serialize.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>

#include "../format.h"
#include "load.cuh"

namespace {

using namespace pyfast_cuda;
using pyfast::format::codes_len;
using pyfast::format::FP8;
using pyfast::format::INT4;
using pyfast::format::INT8;
using pyfast::format::NF4;
using pyfast::format::Quant;
using pyfast::format::scales_len;
using pyfast::format::SIGN;
constexpr unsigned kFull = 0xffffffffu;
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (y + M) - M is rne(y) for |y| < 2^22

// ------------------------------------------------------------------ element access
// format.h's NF4 tables (host constexpr) as device constants.
#define PYFAST_NF4(i) pyfast::format::kNF4[i]
#define PYFAST_NF4T(i) pyfast::format::kNF4Threshold[i]
__constant__ float kNF4Codebook[16] = {
    PYFAST_NF4(0), PYFAST_NF4(1), PYFAST_NF4(2), PYFAST_NF4(3), PYFAST_NF4(4), PYFAST_NF4(5),
    PYFAST_NF4(6), PYFAST_NF4(7), PYFAST_NF4(8), PYFAST_NF4(9), PYFAST_NF4(10), PYFAST_NF4(11),
    PYFAST_NF4(12), PYFAST_NF4(13), PYFAST_NF4(14), PYFAST_NF4(15)};
__constant__ float kNF4Thresholds[15] = {
    PYFAST_NF4T(0), PYFAST_NF4T(1), PYFAST_NF4T(2), PYFAST_NF4T(3), PYFAST_NF4T(4),
    PYFAST_NF4T(5), PYFAST_NF4T(6), PYFAST_NF4T(7), PYFAST_NF4T(8), PYFAST_NF4T(9),
    PYFAST_NF4T(10), PYFAST_NF4T(11), PYFAST_NF4T(12), PYFAST_NF4T(13), PYFAST_NF4T(14)};
#undef PYFAST_NF4
#undef PYFAST_NF4T

__device__ __forceinline__ float rne(float y) { return __fsub_rn(__fadd_rn(y, kMagic), kMagic); }

// u_i = (lowbias32(i + seed * 0x9E3779B9) >> 8) * 2^-24; seed_mix = (uint32)seed * 0x9E3779B9.
__device__ __forceinline__ float uniform(int64_t i, uint32_t seed_mix) {
  uint32_t k = static_cast<uint32_t>(i) + seed_mix;
  k ^= k >> 16; k *= 0x7FEB352Du; k ^= k >> 15; k *= 0x846CA68Bu; k ^= k >> 16;
  return __fmul_rn(__uint2float_rn(k >> 8), 0x1p-24f);  // both steps exact
}

// e4m3fn nearest-even code of a magnitude m in [0, 448], by the integer algorithm.
__device__ __forceinline__ uint32_t e4m3_encode(float m) {
  if (m < 0x1p-6f) return static_cast<uint32_t>(rne(__fmul_rn(m, 512.f)));  // subnormal: 0..8
  uint32_t u = __float_as_uint(m);
  u += 0x7FFFFu + ((u >> 20) & 1u);
  return min((u >> 20) - (120u << 3), 0x7Eu);
}

// Exact magnitude of a code (sign bit ignored): the normal case is built from its bits.
__device__ __forceinline__ float e4m3_decode(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xFu, f = c & 7u;
  return e == 0 ? __fmul_rn(__uint2float_rn(f), 0x1p-9f)
                : __uint_as_float(((e + 120u) << 23) | (f << 20));
}

// One code of a finite block (y = x * inv). y is NaN only for x = 0 with inv = inf (amax so
// tiny that qmax / amax overflows): that zero encodes as 0 rather than as a clamped NaN.
template <int KIND>
__device__ __forceinline__ uint32_t encode(float y, bool stochastic, int64_t i, uint32_t seed_mix) {
  if (y != y) y = 0.f;
  if constexpr (KIND == NF4) {  // #{k : y > t_k}: the nearest codebook entry, ties to the smaller
    uint32_t c = 0;
#pragma unroll
    for (int k = 0; k < 15; ++k) c += y > kNF4Thresholds[k] ? 1u : 0u;
    return c;
  } else if constexpr (KIND == FP8) {
    constexpr float top = pyfast::format::qmax(FP8);
    const float mag = fminf(fabsf(y), top);
    uint32_t c = e4m3_encode(mag);
    if (stochastic) {  // b: the e4m3 neighbour of a on the other side of mag
      const float a = e4m3_decode(c);
      const uint32_t o = a < mag ? c + 1 : (c > 0 ? c - 1 : 0);
      const float b = e4m3_decode(o);
      const float p = b != a ? __fdiv_rn(__fsub_rn(mag, a), __fsub_rn(b, a)) : 0.f;
      if (uniform(i, seed_mix) < p) c = o;
    }
    return (y < 0.f && c != 0) ? (c | 0x80u) : c;  // -0 encodes as 0x00: one code per value
  } else {
    constexpr float qmax = pyfast::format::qmax(Quant(KIND));
    const float q = stochastic ? floorf(__fadd_rn(y, uniform(i, seed_mix))) : rne(y);
    const int v = static_cast<int>(fminf(fmaxf(q, -qmax), qmax));
    return KIND == INT8 ? static_cast<uint32_t>(v) & 0xFFu : static_cast<uint32_t>(v) & 0xFu;
  }
}

// Block-wide max (MAX) or sum of v, broadcast to every thread. blockDim.x is a multiple of 32.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* smem /* [33] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(kFull, v, o);
    v = MAX ? fmaxf(v, w) : __fadd_rn(v, w);
  }
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? smem[lane] : 0.f;  // 0: identity for both
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float w = __shfl_xor_sync(kFull, v, o);
      v = MAX ? fmaxf(v, w) : __fadd_rn(v, w);
    }
    if (lane == 0) smem[32] = v;
  }
  __syncthreads();
  return smem[32];
}

// ------------------------------------------------------------------ quantize
// Chunk k of this block covers elements start + 4k .. +4. CACHE > 0: every chunk of the
// block is one of the thread's CACHE register slots (host guarantees B <= 4 * blockDim * CACHE);
// CACHE == 0: chunks are re-read from global memory in the second pass.
template <int DT, int KIND, int CACHE>
__global__ void __launch_bounds__(256)
quantize_kernel(const void* __restrict__ x, int64_t n, int B, bool vec, bool stochastic,
                uint32_t seed_mix, uint8_t* __restrict__ codes, float* __restrict__ scales) {
  __shared__ float smem[33];
  const int T = blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * B;
  const int nchunks = static_cast<int>((min(static_cast<int64_t>(B), n - start) + 3) / 4);

  // pass 1: amax (NaN counted as +inf so a NaN block is non-finite) or sum |x| for sign
  float acc = 0.f;
  float4 keep[CACHE > 0 ? CACHE : 1];
  auto absorb = [&](const float4& v) {
    const float a[4] = {fabsf(v.x), fabsf(v.y), fabsf(v.z), fabsf(v.w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (KIND == SIGN) acc = __fadd_rn(acc, a[j]);
      else acc = fmaxf(acc, a[j] != a[j] ? __int_as_float(0x7f800000) : a[j]);
    }
  };
  if constexpr (CACHE > 0) {
#pragma unroll
    for (int r = 0; r < CACHE; ++r) {
      const int k = threadIdx.x + r * T;
      keep[r] = k < nchunks ? load4<DT>(x, start + 4 * k, n, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
      absorb(keep[r]);
    }
  } else {
    for (int k = threadIdx.x; k < nchunks; k += T) absorb(load4<DT>(x, start + 4 * k, n, vec));
  }
  const float red = block_reduce<KIND != SIGN>(acc, smem);

  constexpr float qmax = pyfast::format::qmax(Quant(KIND));
  const float kNaN = __int_as_float(0x7fc00000);  // the NaN torch writes for float("nan")
  bool finite;
  float inv = 0.f;
  if constexpr (KIND == SIGN) {
    const int len = static_cast<int>(min(static_cast<int64_t>(B), n - start));
    const float mean = __fdiv_rn(red, static_cast<float>(len));
    finite = isfinite(mean);
    if (threadIdx.x == 0) scales[blockIdx.x] = finite ? mean : kNaN;
  } else {
    finite = red != __int_as_float(0x7f800000);
    // (1 / amax) * qmax, two roundings: the torch reference's `qmax / amax` (Python scalar over
    // a tensor) runs as amax.reciprocal() * qmax, and codes must match it bit for bit.
    if (finite && red > 0.f) inv = __fmul_rn(__frcp_rn(red), qmax);
    if (threadIdx.x == 0) scales[blockIdx.x] = finite ? __fdiv_rn(red, qmax) : kNaN;
  }

  // pass 2: codes. Every thread of a warp runs each step (sign pairs lanes with a shuffle).
  auto emit = [&](int k, const float4& v) {
    const int64_t i = start + 4 * static_cast<int64_t>(k);
    const float xs[4] = {v.x, v.y, v.z, v.w};
    if constexpr (KIND == SIGN) {
      uint32_t nib = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) nib |= (xs[j] < 0.f ? 1u : 0u) << j;
      const uint32_t hi = __shfl_down_sync(kFull, nib, 1);  // chunk k + 1 is lane + 1
      if ((k & 1) == 0 && k < nchunks) codes[i >> 3] = static_cast<uint8_t>(nib | (hi << 4));
      return;
    } else {
      if (k >= nchunks) return;
      uint32_t c[4] = {0, 0, 0, 0};  // non-finite block: all codes 0
      if (finite) {
#pragma unroll
        for (int j = 0; j < 4; ++j)  // nf4's pad nibble is 0, not the code of 0.0 (7)
          if (KIND != NF4 || i + j < n)
            c[j] = encode<KIND>(__fmul_rn(xs[j], inv), stochastic, i + j, seed_mix);
      }
      if constexpr (KIND == INT4 || KIND == NF4) {
        const uint32_t b0 = c[0] | (c[1] << 4), b1 = c[2] | (c[3] << 4);
        if (i + 4 <= n) {
          *reinterpret_cast<uint16_t*>(codes + (i >> 1)) = static_cast<uint16_t>(b0 | (b1 << 8));
        } else {  // tail: bytes up to ceil(n / 2); the pad nibble is 0 (padding quantizes to 0)
          codes[i >> 1] = static_cast<uint8_t>(b0);
          if (i + 2 < n) codes[(i >> 1) + 1] = static_cast<uint8_t>(b1);
        }
      } else {
        if (i + 4 <= n) {
          *reinterpret_cast<uint32_t*>(codes + i) = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
        } else {
          for (int j = 0; j < 4 && i + j < n; ++j) codes[i + j] = static_cast<uint8_t>(c[j]);
        }
      }
    }
  };
  if constexpr (CACHE > 0) {
#pragma unroll
    for (int r = 0; r < CACHE; ++r)
      if (r * T < nchunks) emit(threadIdx.x + r * T, keep[r]);
  } else {
    for (int k0 = 0; k0 < nchunks; k0 += T) {
      const int k = k0 + threadIdx.x;
      emit(k, k < nchunks ? load4<DT>(x, start + 4 * k, n, vec) : make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
}

// ------------------------------------------------------------------ dequantize
__device__ __forceinline__ float int4_value(uint32_t nib) {  // two's complement nibble
  return static_cast<float>(static_cast<int>(nib ^ 8u) - 8);
}

// fp32 code values of elements [i, i + 4) (those past n are never stored).
// lut: nf4's codebook (shared memory), unused by the other kinds.
template <int KIND>
__device__ __forceinline__ float4 decode4(const uint8_t* __restrict__ codes, int64_t i, int64_t n,
                                          bool vec, const float* lut) {
  if constexpr (KIND == SIGN) {  // 4 bits of byte i / 8: low nibble for even chunks
    const uint32_t bits = (static_cast<uint32_t>(codes[i >> 3]) >> (i & 4)) & 0xFu;
    return make_float4(bits & 1 ? -1.f : 1.f, bits & 2 ? -1.f : 1.f,
                       bits & 4 ? -1.f : 1.f, bits & 8 ? -1.f : 1.f);
  } else if constexpr (KIND == INT4 || KIND == NF4) {
    uint32_t w;
    if (vec && i + 4 <= n) w = *reinterpret_cast<const uint16_t*>(codes + (i >> 1));
    else w = codes[i >> 1] | (i + 2 < n ? uint32_t{codes[(i >> 1) + 1]} << 8 : 0u);
    if constexpr (KIND == NF4)
      return make_float4(lut[w & 0xF], lut[(w >> 4) & 0xF], lut[(w >> 8) & 0xF], lut[w >> 12]);
    return make_float4(int4_value(w & 0xF), int4_value((w >> 4) & 0xF),
                       int4_value((w >> 8) & 0xF), int4_value(w >> 12));
  } else {
    uint32_t w = 0;
    if (vec && i + 4 <= n) w = *reinterpret_cast<const uint32_t*>(codes + i);
    else for (int j = 0; j < 4 && i + j < n; ++j) w |= static_cast<uint32_t>(codes[i + j]) << (8 * j);
    float r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t c = (w >> (8 * j)) & 0xFFu;
      if constexpr (KIND == INT8) r[j] = static_cast<float>(static_cast<int8_t>(c));
      else r[j] = c & 0x80u ? -e4m3_decode(c) : e4m3_decode(c);
    }
    return make_float4(r[0], r[1], r[2], r[3]);
  }
}

template <int DT>
__device__ __forceinline__ uint32_t narrow16(float v) {  // one round-to-nearest-even
  if constexpr (DT == BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else return __half_as_ushort(__float2half_rn(v));
}

// OUT: an output Dt (out = dtype(decode * scale)), or ACC (fp32 out += decode * scale).
constexpr int ACC = 3;
template <int KIND, int OUT>
__global__ void __launch_bounds__(256)
dequantize_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, int64_t n,
                  int log2B, bool vec, void* __restrict__ out) {
  __shared__ float lut[16];
  if constexpr (KIND == NF4) {
    if (threadIdx.x < 16) lut[threadIdx.x] = kNF4Codebook[threadIdx.x];
    __syncthreads();
  }
  const int64_t nchunks = (n + 3) / 4;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < nchunks;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * k;
    const float s = scales[i >> log2B];  // B >= 32: the chunk is inside one quant block
    const float4 d = decode4<KIND>(codes, i, n, vec, lut);
    float v[4] = {__fmul_rn(d.x, s), __fmul_rn(d.y, s), __fmul_rn(d.z, s), __fmul_rn(d.w, s)};
    const bool full = vec && i + 4 <= n;
    if constexpr (OUT == F32 || OUT == ACC) {
      float* o = static_cast<float*>(out) + i;
      if (full) {
        float4 w = make_float4(v[0], v[1], v[2], v[3]);
        if constexpr (OUT == ACC) {
          const float4 a = *reinterpret_cast<const float4*>(o);
          w = make_float4(__fadd_rn(a.x, w.x), __fadd_rn(a.y, w.y),
                          __fadd_rn(a.z, w.z), __fadd_rn(a.w, w.w));
        }
        *reinterpret_cast<float4*>(o) = w;
      } else {
        for (int j = 0; j < 4 && i + j < n; ++j) o[j] = OUT == ACC ? __fadd_rn(o[j], v[j]) : v[j];
      }
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + i;
      if (full) {
        *reinterpret_cast<uint2*>(o) = make_uint2(narrow16<OUT>(v[0]) | (narrow16<OUT>(v[1]) << 16),
                                                  narrow16<OUT>(v[2]) | (narrow16<OUT>(v[3]) << 16));
      } else {
        for (int j = 0; j < 4 && i + j < n; ++j) o[j] = static_cast<uint16_t>(narrow16<OUT>(v[j]));
      }
    }
  }
}

// ------------------------------------------------------------------ host side
// check_block's range keeps B in int.
int check_block(int64_t block) { return static_cast<int>(pyfast::format::check_block(block)); }

Dt dt_of(at::ScalarType t, const char* what) {
  if (t == at::kFloat) return F32;
  if (t == at::kBFloat16) return BF16;
  PYFAST_CHECK_TYPE(t == at::kHalf, what, " must be float32, bfloat16 or float16, got ", t);
  return F16;
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <int DT, int KIND>
void launch_quantize(const at::Tensor& x, int64_t n, int B, bool stochastic, uint32_t seed_mix,
                     at::Tensor& codes, at::Tensor& scales, cudaStream_t stream) {
  const int T = std::min(256, std::max(32, B / 4));  // a multiple of 32 (sign pairs lanes)
  const int64_t nb = scales_len(n, B);
  const bool vec = aligned(x.data_ptr(), DT == F32 ? 16 : 8);  // B % 4 == 0 keeps chunks aligned
  auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(nb), T, 0, stream>>>(x.data_ptr(), n, B, vec, stochastic,
                                                        seed_mix, codes.data_ptr<uint8_t>(),
                                                        scales.data_ptr<float>());
  };
  if (B <= 4 * T) launch(quantize_kernel<DT, KIND, 1>);
  else if (B <= 16 * T) launch(quantize_kernel<DT, KIND, 4>);
  else launch(quantize_kernel<DT, KIND, 0>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int DT>
void quantize_dt(Quant k, const at::Tensor& x, int64_t n, int B, bool sto, uint32_t mix,
                 at::Tensor& codes, at::Tensor& scales, cudaStream_t s) {
  switch (k) {
    case INT8: return launch_quantize<DT, INT8>(x, n, B, sto, mix, codes, scales, s);
    case INT4: return launch_quantize<DT, INT4>(x, n, B, sto, mix, codes, scales, s);
    case FP8: return launch_quantize<DT, FP8>(x, n, B, sto, mix, codes, scales, s);
    case SIGN: return launch_quantize<DT, SIGN>(x, n, B, sto, mix, codes, scales, s);
    case NF4: return launch_quantize<DT, NF4>(x, n, B, sto, mix, codes, scales, s);
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x_in, c10::string_view kind_s,
                                                 int64_t block, bool stochastic, int64_t seed) {
  const Quant kind = pyfast::format::parse(kind_s);
  const int B = check_block(block);
  const Dt dt = dt_of(x_in.scalar_type(), "quantize input");
  PYFAST_CHECK_VALUE(!(stochastic && kind == SIGN),
                    "sign has no stochastic rounding: its codes are exact signs");
  PYFAST_CHECK_VALUE(!(stochastic && kind == NF4),
                    "nf4 has no stochastic rounding: it quantizes a frozen weight once, to the "
                    "nearest codebook entry");
  PYFAST_CHECK(x_in.is_cuda(), "quantize (CUDA): input must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();  // flattened view of the elements in order
  const int64_t n = x.numel(), nb = scales_len(n, B);
  PYFAST_CHECK_VALUE(nb < (int64_t{1} << 31), "quantize (CUDA): ", nb, " blocks exceed the grid limit");
  at::Tensor codes = at::empty({codes_len(n, kind)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nb}, x.options().dtype(at::kFloat));
  if (n == 0) return {codes, scales};
  const uint32_t mix = static_cast<uint32_t>(seed) * 0x9E3779B9u;  // (seed & 0xFFFFFFFF) * phi, mod 2^32
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream();
  if (dt == F32) quantize_dt<F32>(kind, x, n, B, stochastic, mix, codes, scales, s);
  else if (dt == BF16) quantize_dt<BF16>(kind, x, n, B, stochastic, mix, codes, scales, s);
  else quantize_dt<F16>(kind, x, n, B, stochastic, mix, codes, scales, s);
  return {codes, scales};
}

void check_codes(const at::Tensor& codes, const at::Tensor& scales, int64_t n, Quant kind, int B) {
  PYFAST_CHECK(codes.is_cuda() && scales.is_cuda() && codes.device() == scales.device(),
              "dequantize (CUDA): codes and scales must be on one CUDA device");
  pyfast::format::check_layout(codes, scales, n, kind, B);
}

template <int KIND, int OUT>
void launch_dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int B,
                       void* out) {
  const int64_t blocks = std::min<int64_t>(((n + 3) / 4 + 255) / 256, 65536);  // grid-stride beyond
  const int out_bytes = OUT == BF16 || OUT == F16 ? 8 : 16;
  const bool vec =
      aligned(out, out_bytes) && aligned(codes.data_ptr(), KIND == INT4 || KIND == NF4 ? 2 : 4);
  dequantize_kernel<KIND, OUT><<<static_cast<unsigned>(blocks), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, __builtin_ctz(B), vec, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int OUT>
void dequantize_out(Quant k, const at::Tensor& codes, const at::Tensor& scales, int64_t n, int B,
                    void* out) {
  switch (k) {
    case INT8: return launch_dequantize<INT8, OUT>(codes, scales, n, B, out);
    case INT4: return launch_dequantize<INT4, OUT>(codes, scales, n, B, out);
    case FP8: return launch_dequantize<FP8, OUT>(codes, scales, n, B, out);
    case SIGN: return launch_dequantize<SIGN, OUT>(codes, scales, n, B, out);
    case NF4: return launch_dequantize<NF4, OUT>(codes, scales, n, B, out);
  }
}

at::Tensor dequantize_cuda(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t n,
                           c10::string_view kind_s, int64_t block, at::ScalarType dtype) {
  const Quant kind = pyfast::format::parse(kind_s);
  const int B = check_block(block);
  const Dt dt = dt_of(dtype, "dequantize dtype");
  check_codes(codes_in, scales_in, n, kind, B);
  const c10::cuda::CUDAGuard guard(codes_in.device());
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor out = at::empty({n}, codes.options().dtype(dtype));
  if (n == 0) return out;
  if (dt == F32) dequantize_out<F32>(kind, codes, scales, n, B, out.data_ptr());
  else if (dt == BF16) dequantize_out<BF16>(kind, codes, scales, n, B, out.data_ptr());
  else dequantize_out<F16>(kind, codes, scales, n, B, out.data_ptr());
  return out;
}

void dequantize_accumulate_cuda(const at::Tensor& out, const at::Tensor& codes_in,
                                const at::Tensor& scales_in, c10::string_view kind_s, int64_t block) {
  const Quant kind = pyfast::format::parse(kind_s);
  const int B = check_block(block);
  PYFAST_CHECK_VALUE(out.scalar_type() == at::kFloat && out.is_contiguous(),
                    "accumulate buffer must be contiguous float32, got ", out.scalar_type());
  PYFAST_CHECK(out.is_cuda() && out.device() == codes_in.device(),
              "dequantize_accumulate_ (CUDA): out, codes and scales must be on one CUDA device");
  const int64_t n = out.numel();
  check_codes(codes_in, scales_in, n, kind, B);
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  if (n > 0) dequantize_out<ACC>(kind, codes, scales, n, B, out.data_ptr());
}

}  // namespace

TORCH_LIBRARY_IMPL(pyfast, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dequantize_accumulate_", &dequantize_accumulate_cuda);
}
