// The quantization formats (docs/FORMATS.md), defined once for the C++ kernels
// (csrc/quantize.cpp), the CUDA kernels (csrc/cuda/quantize.cu) and the engine's codec (wire.h).
// pyfast/ops/quantize.py's FORMATS is the same table for Python and Triton.
// Host code only; nvcc compiles it too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "check.h"

#include <cstdint>

namespace pyfast {
namespace format {

enum Quant : int { INT8, INT4, FP8, SIGN };  // the kernels' template argument

struct Spec {
  const char* name;  // the ops' kind string
  float qmax;        // largest code magnitude; sign has none (its scale is mean |x|)
  int per_byte;      // elements per code byte
};
constexpr Spec kSpecs[] = {{"int8", 127.f, 1}, {"int4", 7.f, 2}, {"fp8", 448.f, 1}, {"sign", 0.f, 8}};
constexpr int kCount = sizeof(kSpecs) / sizeof(kSpecs[0]);

constexpr float qmax(Quant k) { return kSpecs[k].qmax; }
// Scales lead the wire image (fp32[scales_len]), then the codes (uint8[codes_len]).
constexpr int64_t codes_len(int64_t n, Quant k) { return (n + kSpecs[k].per_byte - 1) / kSpecs[k].per_byte; }
constexpr int64_t scales_len(int64_t n, int64_t block) { return (n + block - 1) / block; }

constexpr int64_t kMinBlock = 32, kMaxBlock = 65536;  // powers of two; the default is Python's

// S: std::string_view (CPU) or c10::string_view (the CUDA ops' schema type).
template <class S>
Quant parse(const S& kind) {
  for (int k = 0; k < kCount; ++k)
    if (kind == S(kSpecs[k].name)) return static_cast<Quant>(k);
  PYFAST_CHECK_VALUE(false, "unknown quantization kind '", kind, "'; valid: int8, int4, fp8, sign");
}

inline int64_t check_block(int64_t block) {
  PYFAST_CHECK_VALUE(block >= kMinBlock && block <= kMaxBlock && (block & (block - 1)) == 0,
                    "block size must be a power of two in [", kMinBlock, ", ", kMaxBlock,
                    "], got ", block);
  return block;
}

// codes / scales of n elements as quantize(kind, block) writes them.
inline void check_layout(const at::Tensor& codes, const at::Tensor& scales, int64_t n, Quant k,
                         int64_t block) {
  PYFAST_CHECK_VALUE(n >= 0, "element count must be >= 0, got ", n);
  PYFAST_CHECK_VALUE(codes.scalar_type() == at::kByte && codes.numel() == codes_len(n, k),
                    "codes for ", n, " elements must be uint8[", codes_len(n, k), "], got ",
                    codes.scalar_type(), "[", codes.numel(), "]");
  PYFAST_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.numel() == scales_len(n, block),
                    "scales for ", n, " elements in blocks of ", block, " must be float32[",
                    scales_len(n, block), "], got ", scales.scalar_type(), "[", scales.numel(), "]");
}

}  // namespace format
}  // namespace pyfast
