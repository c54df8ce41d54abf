#pragma once

/// \file
/// Cutting a call's arguments into per-replica chunks and putting the
/// replicas' outputs back together: the markers a caller puts on arguments,
/// how 0-dim outputs combine, and how rows are divided. How nested values are
/// walked is in detail/scatter_gather.h. See Note [DataParallel step] in
/// data_parallel.h for where this sits in a training step.

#include <torch/types.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

/// A tensor that every replica receives whole instead of a chunk of it: a
/// shared batch-1 input, a lookup table, a mask. Its gradient is the sum of
/// the replicas' gradients. Make one with `lockstep::broadcast(t)`.
struct Broadcast {
  /// The tensor every replica receives, moved to the replica's device.
  torch::Tensor tensor;
};

/// A tensor split along its own dimension instead of DataParallel's `dim`.
/// Make one with `lockstep::split(t, dim)`.
struct Split {
  /// The tensor to split, one chunk per replica.
  torch::Tensor tensor;
  /// The dimension it is split along; negative counts from the end.
  int64_t dim;
};

/// A value of a type DataParallel cannot look into (a struct of your own),
/// copied as it is to every replica. Tensors inside it are not moved to the
/// replica's device, not split, and get no gradient through DataParallel.
/// Make one with `lockstep::broadcast(value)`.
template <typename T>
struct BroadcastValue {
  /// The value every replica receives a copy of.
  T value;
};

/// Marks `tensor` to be passed whole to every replica.
inline Broadcast broadcast(torch::Tensor tensor) {
  return Broadcast{std::move(tensor)};
}

/// Marks a value of any other type to be copied as it is to every replica.
template <typename T, typename = std::enable_if_t<!std::is_convertible<T, torch::Tensor>::value>>
BroadcastValue<std::decay_t<T>> broadcast(T&& value) {
  return BroadcastValue<std::decay_t<T>>{std::forward<T>(value)};
}

/// Marks `tensor` to be split along `dim` (negative counts from the end).
inline Split split(torch::Tensor tensor, int64_t dim) {
  return Split{std::move(tensor), dim};
}

/// How 0-dim outputs (losses, metrics) of the replicas are combined.
enum class ScalarGather {
  /// A 1-D tensor with one entry per replica that ran, as PyTorch does.
  Stack,
  /// The replicas' values weighted by their share of the batch: for a
  /// mean-reduced loss, exactly the single-device value. Floating-point
  /// outputs only: an integer or bool one (a count, a flag) is an error.
  Mean,
  /// The plain sum of the replicas' values.
  Sum,
};

/// Splits `batch` rows between `replicas` as evenly as possible, or in
/// proportion to `weights` (one positive weight per replica) when given.
/// Uses largest remainders, so sizes sum to `batch` and differ from the exact
/// share by less than one row; ties go to the lower index. A replica may get
/// 0 rows when `batch` is smaller than the number of replicas. At most 65536
/// replicas, and 2^53 rows.
std::vector<int64_t> chunk_sizes(
    int64_t batch,
    int64_t replicas,
    const std::vector<double>& weights = {});

} // namespace lockstep

#include <lockstep/detail/scatter_gather.h>
