#pragma once

// Internal: what part of a flat parameter a rank saves in PyTorch's
// distributed checkpoint layout, as boxes of its parameters (Note [A flat
// shard as boxes]): its weights (src/fsdp/dcp_checkpoint.cpp) and the
// optimizer's state for them (src/fsdp/dcp_optimizer.cpp).

#include "fsdp/flat_param.h"
#include "io/dcp_hf.h"

#include <c10/util/accumulate.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

/// What part of a flat buffer's elements rank `rank` holds and saves: its
/// shard; all of it on rank 0 when not `sharded` (every rank holds the same).
inline std::pair<int64_t, int64_t> saved_range(const FlatParam& flat, int rank, bool sharded) {
  if (!sharded) {
    return rank == 0 ? std::make_pair(int64_t{0}, flat.layout.numel) : std::make_pair(int64_t{0}, int64_t{0});
  }
  const int64_t begin = std::min(rank * flat.layout.shard, flat.layout.numel);
  return {begin, std::min(begin + flat.layout.shard, flat.layout.numel)};
}

/// Calls fn(j, box, at) for each box of each parameter of `flat` within
/// elements [begin, end) of the flat buffer; `at` is the box's first
/// element's place in that range.
template <typename Fn>
void for_each_box(const FlatParam& flat, int64_t begin, int64_t end, Fn fn) {
  for (size_t j = 0; j < flat.params.size(); ++j) {
    const int64_t first = flat.offsets[j];
    const int64_t last = first + c10::multiply_integers(flat.shapes[j]);
    const int64_t from = std::max(first, begin);
    const int64_t to = std::min(last, end);
    if (from >= to) {
      continue;
    }
    int64_t at = from - begin;
    for (auto& box : boxes_of_range(flat.shapes[j], from - first, to - first)) {
      const int64_t numel = box.numel();
      fn(j, std::move(box), at);
      at += numel;
    }
  }
}

/// The boxes that rank `rank` saves of `shard`, a tensor laid out as the
/// flat's shard (its values, or the optimizer's exp_avg for them), each
/// named name_of(j) for the flat's parameter j.
inline std::vector<BoxSource> shard_boxes_of(const FlatParam& flat, const torch::Tensor& shard, int rank, bool sharded,
                                             const std::function<std::string(size_t)>& name_of) {
  std::vector<BoxSource> boxes;
  const auto [begin, end] = saved_range(flat, rank, sharded);
  for_each_box(flat, begin, end, [&](size_t j, Box box, int64_t at) {
    const auto sizes = box.sizes;
    boxes.push_back({name_of(j), shard.scalar_type(), std::move(box), [shard, at, sizes] {
                       torch::NoGradGuard no_grad;
                       return shard.detach().reshape({-1}).narrow(0, at, c10::multiply_integers(sizes)).cpu()
                           .contiguous().view(sizes);
                     }});
  });
  for (size_t j = 0; j < flat.shapes.size() && rank == 0; ++j) {
    if (c10::multiply_integers(flat.shapes[j]) == 0) { // in no range; its shape is its one empty box, as in FSDP2's saves
      Box box;
      box.sizes = flat.shapes[j];
      box.offsets.assign(box.sizes.size(), 0);
      const auto options = shard.options().device(torch::kCPU);
      boxes.push_back({name_of(j), shard.scalar_type(), box, [sizes = box.sizes, options] {
                         return torch::empty(sizes, options);
                       }});
    }
  }
  return boxes;
}

/// The box that is all of `tensor`.
inline Box whole_box(const torch::Tensor& tensor) {
  Box box;
  box.sizes = tensor.sizes().vec();
  box.offsets.assign(box.sizes.size(), 0);
  return box;
}

} // namespace detail
} // namespace lockstep
