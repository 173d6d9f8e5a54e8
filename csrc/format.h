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

enum Quant : int { INT8, INT4, FP8, SIGN, NF4 };  // the kernels' template argument

struct Spec {
  const char* name;  // the ops' kind string
  float qmax;        // largest code magnitude; sign has none (its scale is mean |x|); nf4's
                     // codebook spans [-1, 1], so its scale is amax
  int per_byte;      // elements per code byte
};
constexpr Spec kSpecs[] = {{"int8", 127.f, 1}, {"int4", 7.f, 2}, {"fp8", 448.f, 1},
                           {"sign", 0.f, 8}, {"nf4", 1.f, 2}};
constexpr int kCount = sizeof(kSpecs) / sizeof(kSpecs[0]);

constexpr float qmax(Quant k) { return kSpecs[k].qmax; }

// NF4 (QLoRA, arXiv:2305.14314 Appendix E; bitsandbytes' nf4 table) as exact fp32 hex:
// kernels/formats.py's NF4_CODEBOOK. Code c decodes to kNF4[c] * scale.
constexpr float kNF4[16] = {
    -0x1p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f, -0x1.23449ap-2f, -0x1.7a6a7ep-3f,
    -0x1.74f0e2p-4f, 0.f, 0x1.45f5fep-4f, 0x1.4995c6p-3f, 0x1.f809bap-3f, 0x1.5a0674p-2f,
    0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f, 0x1p+0f};
// kNF4Threshold[k]: the largest fp32 <= the midpoint of kNF4[k] and kNF4[k + 1]; the code of y
// is #{k : y > kNF4Threshold[k]} (nearest entry, ties to the smaller): NF4_THRESHOLDS.
constexpr float kNF4Threshold[15] = {
    -0x1.b239b2p-1f, -0x1.38a4e2p-1f, -0x1.d709p-2f, -0x1.5bd4eep-2f, -0x1.e079dap-3f,
    -0x1.1a7178p-3f, -0x1.74f0e2p-5f, 0x1.45f5fep-5f, 0x1.ec90c4p-4f, 0x1.a0cfcp-3f,
    0x1.2b05a8p-2f, 0x1.8ea7f2p-2f, 0x1.00da06p-1f, 0x1.491b5ep-1f, 0x1.b913b2p-1f};
// Scales lead the wire image (fp32[scales_len]), then the codes (uint8[codes_len]).
constexpr int64_t codes_len(int64_t n, Quant k) { return (n + kSpecs[k].per_byte - 1) / kSpecs[k].per_byte; }
constexpr int64_t scales_len(int64_t n, int64_t block) { return (n + block - 1) / block; }

constexpr int64_t kMinBlock = 32, kMaxBlock = 65536;  // powers of two; the default is Python's

// S: std::string_view (CPU) or c10::string_view (the CUDA ops' schema type).
template <class S>
Quant parse(const S& kind) {
  for (int k = 0; k < kCount; ++k)
    if (kind == S(kSpecs[k].name)) return static_cast<Quant>(k);
  PYFAST_CHECK_VALUE(false, "unknown quantization kind '", kind,
                    "'; valid: int8, int4, fp8, sign, nf4");
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
