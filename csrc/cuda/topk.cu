// CUDA kernels for pyfast::topk_count / topk_select (docs/FORMATS.md, "topk_*").
//
// r_i = fp32(x_i) + ef_i (one fp32 add), hit_i = |r_i| >= t with t rounded to fp32 once on the
// host, as torch does when it compares an fp32 tensor with a Python float.
// The input is cut into tiles of kTile elements, one thread block each, walked in kRounds
// rounds of 256 threads x 4 consecutive elements (16-byte loads of x and ef, a warp reads 512
// contiguous bytes). topk_select is an ordered compaction:
//   1. count kernel: hits per tile;
//   2. at::cumsum over the tile counts (CUB scan inside ATen): each tile's first output slot;
//   3. write kernel: per round a block-wide exclusive scan of the per-thread hit counts gives
//      every hit its slot, so indices come out ascending; slots >= cap = min(limit, n) are
//      dropped (the `limit`), and ef is rewritten in the same pass (fused error feedback).
// The write kernel runs before the host learns the total, so the one device-to-host sync
// (for the output length) comes after all the work, not between kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "../check.h"
#include "load.cuh"

namespace {

using namespace pyfast_cuda;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256, kWarps = kThreads / 32, kRounds = 8;
constexpr int kTile = kThreads * 4 * kRounds;  // 8192 elements: 2048 tiles for 16M


// Residuals of elements [i, i + 4): r = fp32(x) + ef (ef == nullptr: r = fp32(x)).
template <int DT>
__device__ __forceinline__ void residual4(const void* x, const float* ef, int64_t i, int64_t n,
                                          bool vec, float (&r)[4]) {
  const float4 xv = load4<DT>(x, i, n, vec);
  r[0] = xv.x; r[1] = xv.y; r[2] = xv.z; r[3] = xv.w;
  if (ef != nullptr) {
    const float4 e = load4<F32>(ef, i, n, vec);
    r[0] = __fadd_rn(r[0], e.x); r[1] = __fadd_rn(r[1], e.y);
    r[2] = __fadd_rn(r[2], e.z); r[3] = __fadd_rn(r[3], e.w);
  }
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Hits (and, for topk_count, non-finite residuals) of tile blockIdx.x.
// PER_TILE: counts[tile] = hits (topk_select's first pass); else atomically added to out[0..1].
template <int DT, bool PER_TILE>
__global__ void __launch_bounds__(kThreads)
count_kernel(const void* __restrict__ x, const float* __restrict__ ef, int64_t n, float t,
             bool vec, int* __restrict__ counts, unsigned long long* __restrict__ out) {
  __shared__ int smem[2][kWarps];
  const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * kTile;
  int hits = 0, bad = 0;
#pragma unroll 2
  for (int round = 0; round < kRounds; ++round) {
    const int64_t i = tile0 + 4 * static_cast<int64_t>(round * kThreads + threadIdx.x);
    if (i >= n) break;  // later rounds are further out
    float r[4];
    residual4<DT>(x, ef, i, n, vec, r);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool valid = i + j < n;
      hits += valid && fabsf(r[j]) >= t;
      if (!PER_TILE) bad += valid && !(fabsf(r[j]) < __int_as_float(0x7f800000));  // NaN or Inf
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  hits = warp_sum(hits);
  if (!PER_TILE) bad = warp_sum(bad);
  if (lane == 0) { smem[0][warp] = hits; smem[1][warp] = bad; }
  __syncthreads();
  if (warp == 0) {
    hits = warp_sum(lane < kWarps ? smem[0][lane] : 0);
    if (!PER_TILE) bad = warp_sum(lane < kWarps ? smem[1][lane] : 0);
    if (lane == 0) {
      if (PER_TILE) {
        counts[blockIdx.x] = hits;
      } else {  // integer sums: the result does not depend on the order of the atomics
        if (hits) atomicAdd(out, static_cast<unsigned long long>(hits));
        if (bad) atomicAdd(out + 1, static_cast<unsigned long long>(bad));
      }
    }
  }
}

template <int DT>
__device__ __forceinline__ void store_value(void* values, int slot, float v) {
  if constexpr (DT == F32) static_cast<float*>(values)[slot] = v;
  else if constexpr (DT == BF16) static_cast<__nv_bfloat16*>(values)[slot] = __float2bfloat16_rn(v);
  else static_cast<__half*>(values)[slot] = __float2half_rn(v);
}

// fp32(x.dtype(v)): the value actually sent, for the error-feedback remainder.
template <int DT>
__device__ __forceinline__ float round_trip(float v) {
  if constexpr (DT == F32) return v;
  else if constexpr (DT == BF16) return __bfloat162float(__float2bfloat16_rn(v));
  else return __half2float(__float2half_rn(v));
}

// Ordered write of tile blockIdx.x. incl: inclusive scan of the tile counts. Slot s < cap gets
// (values[s], indices[s]); with ef, ef_i = r_i - fp32(value) for those and r_i for the rest.
template <int DT, bool EF>
__global__ void __launch_bounds__(kThreads)
select_kernel(const void* __restrict__ x, float* __restrict__ ef, int64_t n, float t, bool vec,
              const int* __restrict__ incl, int cap, void* __restrict__ values,
              int* __restrict__ indices) {
  __shared__ int warp_hits[kWarps];
  const int tile = blockIdx.x;
  int base = tile ? incl[tile - 1] : 0;  // slot of this tile's first hit (uniform per block)
  if (!EF && base >= cap) return;        // the limit is used up before this tile
  const int64_t tile0 = static_cast<int64_t>(tile) * kTile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int round = 0; round < kRounds; ++round) {
    const int64_t i = tile0 + 4 * static_cast<int64_t>(round * kThreads + threadIdx.x);
    if (tile0 + 4 * static_cast<int64_t>(round * kThreads) >= n) break;  // uniform exit
    float r[4];
    residual4<DT>(x, EF ? ef : nullptr, i, n, vec, r);
    if (base < cap) {  // uniform: once the limit is reached only ef remains to be written
      int c = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) c += (i + j < n) && fabsf(r[j]) >= t;
      // block-wide exclusive scan of c: in-warp inclusive scan, then the warp totals
      int incl_c = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int w = __shfl_up_sync(kFull, incl_c, o);
        if (lane >= o) incl_c += w;
      }
      if (lane == 31) warp_hits[warp] = incl_c;
      __syncthreads();
      int before = 0, total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const int h = warp_hits[w];
        before += w < warp ? h : 0;
        total += h;
      }
      __syncthreads();  // warp_hits is rewritten next round
      int slot = base + before + incl_c - c;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if ((i + j < n) && fabsf(r[j]) >= t) {
          if (slot < cap) {
            indices[slot] = static_cast<int>(i + j);
            store_value<DT>(values, slot, r[j]);
            if (EF) r[j] = __fsub_rn(r[j], round_trip<DT>(r[j]));  // exact: what was not sent
          }
          ++slot;
        }
      }
      base += total;
    }
    if (EF) {
      if (vec && i + 4 <= n) {
        *reinterpret_cast<float4*>(ef + i) = make_float4(r[0], r[1], r[2], r[3]);
      } else {
        for (int j = 0; j < 4 && i + j < n; ++j) ef[i + j] = r[j];
      }
    }
  }
}

// ------------------------------------------------------------------ host side
Dt check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& ef, const char* op) {
  PYFAST_CHECK(x.is_cuda(), op, " (CUDA): input must be a CUDA tensor");
  const auto st = x.scalar_type();
  PYFAST_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                   "topk takes float32, bfloat16 or float16 tensors, got ", st);
  PYFAST_CHECK_VALUE(x.numel() < (int64_t{1} << 31), "topk indices are int32: ", x.numel(),
                    " elements is too many");
  if (ef.has_value()) {
    PYFAST_CHECK_VALUE(ef->scalar_type() == at::kFloat && ef->is_contiguous() && ef->numel() == x.numel(),
                      "error-feedback buffer must be contiguous float32[", x.numel(), "], got ",
                      ef->scalar_type(), "[", ef->numel(), "]");
    PYFAST_CHECK_VALUE(ef->device() == x.device(), "error feedback on ", ef->device(),
                      " but input on ", x.device());
  }
  return st == at::kFloat ? F32 : st == at::kBFloat16 ? BF16 : F16;
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool can_vectorize(const at::Tensor& x, Dt dt, const float* ef) {  // tiles start at 8192 * k
  return aligned(x.data_ptr(), dt == F32 ? 16 : 8) && (ef == nullptr || aligned(ef, 16));
}

template <bool PER_TILE>
void launch_count(Dt dt, const at::Tensor& x, const float* ef, float t, int* counts,
                  unsigned long long* out, cudaStream_t s) {
  const int64_t n = x.numel();
  const unsigned tiles = static_cast<unsigned>((n + kTile - 1) / kTile);
  const bool vec = can_vectorize(x, dt, ef);
  auto kernel = dt == F32 ? count_kernel<F32, PER_TILE>
              : dt == BF16 ? count_kernel<BF16, PER_TILE> : count_kernel<F16, PER_TILE>;
  kernel<<<tiles, kThreads, 0, s>>>(x.data_ptr(), ef, n, t, vec, counts, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor topk_count_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& ef,
                           double threshold) {
  const Dt dt = check_inputs(x_in, ef, "topk_count");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::zeros({2}, x.options().dtype(at::kLong));  // [hits, non-finite]
  if (x.numel() == 0) return out;
  const float* efp = ef.has_value() ? ef->data_ptr<float>() : nullptr;
  launch_count<false>(dt, x, efp, static_cast<float>(threshold), nullptr,
                      reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()),
                      c10::cuda::getCurrentCUDAStream());
  return out;
}

template <int DT>
void launch_select(const at::Tensor& x, float* ef, float t, bool vec, const int* incl, int cap,
                   at::Tensor& values, at::Tensor& indices, unsigned tiles, cudaStream_t s) {
  const int64_t n = x.numel();
  if (ef != nullptr)
    select_kernel<DT, true><<<tiles, kThreads, 0, s>>>(x.data_ptr(), ef, n, t, vec, incl, cap,
                                                       values.data_ptr(), indices.data_ptr<int>());
  else
    select_kernel<DT, false><<<tiles, kThreads, 0, s>>>(x.data_ptr(), nullptr, n, t, vec, incl, cap,
                                                        values.data_ptr(), indices.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> topk_select_cuda(const at::Tensor& x_in,
                                                    const std::optional<at::Tensor>& ef,
                                                    double threshold, int64_t limit) {
  const Dt dt = check_inputs(x_in, ef, "topk_select");
  PYFAST_CHECK_VALUE(limit >= 0, "topk_select: limit must be >= 0, got ", limit);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int cap = static_cast<int>(std::min(limit, n));
  // Sized for the cap: filled before the total is known, then narrowed to the m hits kept.
  at::Tensor values = at::empty({cap}, x.options());
  at::Tensor indices = at::empty({cap}, x.options().dtype(at::kInt));
  if (n == 0) return {values, indices};
  const float t = static_cast<float>(threshold);
  float* efp = ef.has_value() ? ef->data_ptr<float>() : nullptr;
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream();
  const unsigned tiles = static_cast<unsigned>((n + kTile - 1) / kTile);
  at::Tensor counts = at::empty({tiles}, x.options().dtype(at::kInt));
  launch_count<true>(dt, x, efp, t, counts.data_ptr<int>(), nullptr, s);
  const at::Tensor incl = at::cumsum(counts, 0, at::kInt);  // int32: total <= n < 2^31
  const bool vec = can_vectorize(x, dt, efp);
  const int* ip = incl.data_ptr<int>();
  if (dt == F32) launch_select<F32>(x, efp, t, vec, ip, cap, values, indices, tiles, s);
  else if (dt == BF16) launch_select<BF16>(x, efp, t, vec, ip, cap, values, indices, tiles, s);
  else launch_select<F16>(x, efp, t, vec, ip, cap, values, indices, tiles, s);
  const int64_t m = std::min<int64_t>(cap, incl[tiles - 1].item<int>());  // the one sync
  return {values.narrow(0, 0, m), indices.narrow(0, 0, m)};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyfast, CUDA, m) {
  m.impl("topk_count", &topk_count_cuda);
  m.impl("topk_select", &topk_select_cuda);
}
