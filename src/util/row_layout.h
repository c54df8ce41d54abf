#pragma once

// Internal: which tensor layouts hold a matrix's rows in order.

#include <torch/torch.h>

namespace lockstep {
namespace detail {

/// Whether `t`'s elements fill numel places of memory, dimension 0
/// outermost: its memory is then its rows in order, each row's elements in
/// an order of its own, the same for every row (a channels-last weight's).
/// Read as a rows x cols matrix, that memory is `t`'s matrix with its columns
/// permuted, whose low-rank approximation is `t`'s, permuted alike.
inline bool rows_in_memory(const torch::Tensor& t) {
  return t.is_non_overlapping_and_dense() && (t.dim() == 0 || t.size(0) <= 1 || t.stride(0) * t.size(0) == t.numel());
}

} // namespace detail
} // namespace lockstep
