// The engine's codec: what a dense compressor's compress / to_wire / from_wire / decompress
// (_accumulate_) do in pyfast/compress, in C++, on the same kernels. Wire image of len elements:
// fp16/bf16 values, or fp32 scales then uint8 codes (compress/quant.py: "scales first").
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include "format.h"

#include <string>
#include <utility>
#include <vector>

namespace pyfast {

enum class Kind { None, Fp16, Bf16, Int8, Int4, Fp8, Sign };  // Int8.. in format::Quant's order
static_assert(int(Kind::Sign) - int(Kind::Int8) == format::SIGN, "Kind and format::Quant differ");

inline int64_t round8(int64_t b) { return (b + 7) & ~int64_t(7); }
inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// [start, end) of `parts` chunks of n elements, starts aligned to `align`: collectives._chunks.
inline std::vector<std::pair<int64_t, int64_t>> chunks(int64_t n, int64_t parts, int64_t align) {
  const int64_t per = round_up((n + parts - 1) / parts, align);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < parts; ++i) out.emplace_back(std::min(n, i * per), std::min(n, (i + 1) * per));
  return out;
}

// The pyfast:: ops through the dispatcher, as torch.ops.pyfast calls them from Python: the same
// kernels, so the same bits (and the sign kind's backend-defined sum order is the C++ one).
using QuantizeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::string_view, int64_t,
                                                      bool, int64_t);
using DequantizeFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, c10::string_view,
                                int64_t, at::ScalarType);
using AccumulateFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          c10::string_view, int64_t);

template <class Fn>
const c10::TypedOperatorHandle<Fn>& pyfast_op(const char* name) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
  return op;
}
inline const auto& quantize_op() { return pyfast_op<QuantizeFn>("pyfast::quantize"); }
inline const auto& dequantize_op() { return pyfast_op<DequantizeFn>("pyfast::dequantize"); }
inline const auto& accumulate_op() {
  return pyfast_op<AccumulateFn>("pyfast::dequantize_accumulate_");
}

// One error-feedback memory of a compression: read from `in`, the new one written into `out`
// (the same tensor: in place). Both undefined: no error feedback.
struct Mem {
  at::Tensor in, out;
};

struct Codec {
  Kind kind;
  std::string name;  // the kernels' kind string
  int64_t block;     // quantization block (unused by the casts)

  bool cast() const { return kind == Kind::Fp16 || kind == Kind::Bf16; }
  at::ScalarType wire_dtype() const { return kind == Kind::Fp16 ? at::kHalf : at::kBFloat16; }
  format::Quant quant() const { return format::Quant(int(kind) - int(Kind::Int8)); }
  int64_t scales(int64_t len) const { return format::scales_len(len, block); }
  int64_t bytes(int64_t len) const {  // the compressor's layout(len), in bytes
    if (kind == Kind::None) return 4 * len;
    if (cast()) return 2 * len;
    return 4 * scales(len) + format::codes_len(len, quant());
  }
  // (scales, codes) views of a wire image; slots start 8-byte aligned, so the fp32 view is valid.
  std::pair<at::Tensor, at::Tensor> split(const at::Tensor& buf, int64_t len) const {
    const int64_t s = 4 * scales(len);
    return {buf.narrow(0, 0, s).view(at::kFloat), buf.narrow(0, s, bytes(len) - s)};
  }

  // dst (uint8[bytes(len)]) = wire image of x, through the error-feedback memory ef if defined:
  // r = x + ef; send compress(r); ef_out = r - decompress (compress/base.py
  // compress_with_feedback). ef_out undefined: ef itself (in place); another buffer: ef is
  // left as it was (check_finite="skip" keeps both and swaps on commit: pyfast/comm/guard.py).
  void compress(const at::Tensor& x, const at::Tensor& ef, at::Tensor ef_out,
                const at::Tensor& dst) const {
    // the ranges of pyfast._ranges (pyfast.<area>.<what>): a flag test with no profiler on
    RECORD_FUNCTION("pyfast.codec.compress", std::vector<c10::IValue>());
    const at::Tensor r = ef.defined() ? at::add(x, ef) : x;
    if (ef.defined() && !ef_out.defined()) ef_out = ef;
    if (cast()) {
      at::Tensor w = dst.view(wire_dtype());
      w.copy_(r);  // one rounding, as r.to(fp16)
      if (ef.defined()) at::sub_out(ef_out, r, w.to(at::kFloat));
      return;
    }
    auto [codes, sc] = quantize_op().call(r, name, block, false, 0);
    auto [wire_scales, wire_codes] = split(dst, x.numel());
    wire_scales.copy_(sc);
    wire_codes.copy_(codes);
    if (ef.defined())
      at::sub_out(ef_out, r, dequantize_op().call(codes, sc, x.numel(), name, block, at::kFloat));
  }
  void decode_add(const at::Tensor& buf, const at::Tensor& out) const {  // out += decode(buf)
    RECORD_FUNCTION("pyfast.codec.decode", std::vector<c10::IValue>());
    if (cast()) {
      out.add_(buf.view(wire_dtype()).to(at::kFloat));
      return;
    }
    auto [sc, codes] = split(buf, out.numel());
    accumulate_op().call(out, codes, sc, name, block);
  }
  void decode(const at::Tensor& buf, const at::Tensor& out) const {  // out = decode(buf)
    RECORD_FUNCTION("pyfast.codec.decode", std::vector<c10::IValue>());
    if (cast()) {
      out.copy_(buf.view(wire_dtype()));  // widening is exact
      return;
    }
    auto [sc, codes] = split(buf, out.numel());
    out.copy_(dequantize_op().call(codes, sc, out.numel(), name, block, at::kFloat));
  }
};

}  // namespace pyfast
