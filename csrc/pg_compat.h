// ProcessGroup's flat collectives under both of their names. torch 2.13 calls them
// all_gather_single / reduce_scatter_single / all_to_all_single and keeps the old names
// (_allgather_base / _reduce_scatter_base / alltoall_base) as deprecated aliases; torch 2.11
// (the CUDA build on the lent H200, 2026-11-25) has only the old ones, and pyfast._C failed to
// compile there. Detected by overload, not by version number, so no release in between is
// guessed at.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <type_traits>
#include <utility>
#include <vector>

namespace pyfast::pg {

template <typename PG, typename = void>
struct has_new_names : std::false_type {};
template <typename PG>
struct has_new_names<PG, std::void_t<decltype(std::declval<PG&>().all_gather_single(
                             std::declval<at::Tensor&>(), std::declval<at::Tensor&>()))>>
    : std::true_type {};

template <typename PG>
c10::intrusive_ptr<c10d::Work> all_gather_single(PG& pg, at::Tensor out, at::Tensor in) {
  if constexpr (has_new_names<PG>::value) return pg.all_gather_single(out, in);
  else return pg._allgather_base(out, in);
}

template <typename PG>
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(PG& pg, at::Tensor out, at::Tensor in) {
  if constexpr (has_new_names<PG>::value) return pg.reduce_scatter_single(out, in);
  else return pg._reduce_scatter_base(out, in);
}

template <typename PG>
c10::intrusive_ptr<c10d::Work> all_to_all_single(PG& pg, at::Tensor out, at::Tensor in,
                                                 std::vector<int64_t> out_splits,
                                                 std::vector<int64_t> in_splits) {
  if constexpr (has_new_names<PG>::value)
    return pg.all_to_all_single(out, in, out_splits, in_splits);
  else return pg.alltoall_base(out, in, out_splits, in_splits);
}

}  // namespace pyfast::pg
