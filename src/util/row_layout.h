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

/// The strides of DistributedDataParallel's bucket slot for parameter `p`:
/// its own where they hold its rows in order (a channels-last weight's, as
/// c10d's bucket views take them), so that its gradient keeps its layout
/// and the copies in and out run in memory order; else row-major (a
/// transposed matrix), since PowerSGD compresses the matrix a slot's memory
/// holds.
inline c10::DimVector slot_strides(const torch::Tensor& p) {
  return rows_in_memory(p) ? c10::DimVector(p.strides()) : c10::contiguous_strides(p.sizes());
}

} // namespace detail
} // namespace lockstep
