// Error messages without iostream. TORCH_CHECK formats its arguments through c10::str, an
// ostringstream; on the lent H200 (torch 2.11, its image's /opt/gcc toolchain) _C.so carried
// its own copy of libstdc++'s stream code, and the first message formatted there segfaulted
// (std::codecvt in _C.so, bench/results/gpu_h200.txt): every bad input killed the process
// instead of raising (tests/test_engine.py's bad-input cases, 2026-11-26). PYFAST_CHECK builds
// the message by string arithmetic and hands TORCH_CHECK one std::string, which c10::str
// passes through without a stream.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace pyfast::msg {

inline void put(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
void put(std::string& s, T v) { s += std::to_string(v); }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += ']';
}

template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}

}  // namespace pyfast::msg

#define PYFAST_CHECK(cond, ...) TORCH_CHECK(cond, ::pyfast::msg::cat(__VA_ARGS__))
#define PYFAST_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::pyfast::msg::cat(__VA_ARGS__))
#define PYFAST_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::pyfast::msg::cat(__VA_ARGS__))
