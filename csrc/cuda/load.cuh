// Element access shared by the CUDA kernels: fp32 / bf16 / fp16 inputs widened to fp32,
// four at a time (16-byte loads for fp32, 8-byte for 16-bit types).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace pyfast_cuda {

enum Dt { F32, BF16, F16 };

template <int DT>
__device__ __forceinline__ float widen(uint32_t bits16) {
  if constexpr (DT == BF16) return __uint_as_float(bits16 << 16);  // exact
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}

template <int DT>
__device__ __forceinline__ float load1(const void* p, int64_t i) {
  if constexpr (DT == F32) return static_cast<const float*>(p)[i];
  else return widen<DT>(static_cast<const uint16_t*>(p)[i]);
}

// Elements [i, i + 4) widened to fp32; those at or past n read as 0 (neutral for amax and
// sum, and quantize to code 0 / sign bit 0, which is exactly the padding FORMATS.md wants).
// `vec`: the base pointer is aligned for one vector load per chunk (uniform per launch).
template <int DT>
__device__ __forceinline__ float4 load4(const void* p, int64_t i, int64_t n, bool vec) {
  if (vec && i + 4 <= n) {
    if constexpr (DT == F32) {
      return *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    } else {
      const uint2 r = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
      return make_float4(widen<DT>(r.x & 0xffffu), widen<DT>(r.x >> 16),
                         widen<DT>(r.y & 0xffffu), widen<DT>(r.y >> 16));
    }
  }
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (i < n) v.x = load1<DT>(p, i);
  if (i + 1 < n) v.y = load1<DT>(p, i + 1);
  if (i + 2 < n) v.z = load1<DT>(p, i + 2);
  if (i + 3 < n) v.w = load1<DT>(p, i + 3);
  return v;
}

}  // namespace pyfast_cuda
