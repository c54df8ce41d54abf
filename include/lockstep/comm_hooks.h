#pragma once

/// \file
/// Communication hooks: how DistributedDataParallel reduces one bucket of
/// gradients, as PyTorch's register_comm_hook. A hook starts the reduction
/// while backward goes on and returns something to wait on; the reducer waits
/// at the end of backward, in bucket order.

#include <lockstep/process_group.h>

#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {

/// One bucket's gradients, flattened in one tensor, as a communication hook
/// sees them.
struct GradBucket {
  /// Position in reduction order: 0 is the first bucket backward fills.
  size_t index = 0;
  /// The bucket's gradients, concatenated; the hook may modify it in place.
  torch::Tensor buffer;
  /// Indices of the bucket's parameters among the reduced parameters: the
  /// module's parameters() that require a gradient, a shared one once, at
  /// its first name (DistributedDataParallel's buckets()).
  std::vector<size_t> parameters;
  /// "bucket 2 (5 parameters, 1.0 MiB)": names the bucket in errors.
  std::string name;
  /// Views of `buffer`, one per parameter in `parameters`, shaped as the
  /// parameter (PyTorch's GradBucket::gradients): for layer-wise hooks. Each
  /// has its parameter's strides where they hold its rows in order (a
  /// channels-last weight's), else is contiguous: reshape() rather than
  /// view() to flatten one.
  std::vector<torch::Tensor> gradients;
  /// Whether this is the iteration's last bucket (PyTorch's is_last).
  bool last = false;
  /// The DistributedDataParallel reducing this bucket, the same for all its
  /// buckets (empty where a bucket is made by hand): for hooks that keep
  /// state per model, as PowerSGD does.
  std::weak_ptr<const void> model;
};

/// What a communication hook returns: the bucket averaged over ranks, now or
/// after wait().
class PendingReduction {
 public:
  virtual ~PendingReduction() = default;
  /// The averaged gradients: `buffer` itself or a tensor of its size.
  virtual torch::Tensor wait() = 0;
};

/// Starts the reduction of one bucket. Called in bucket order, the same on
/// every rank, while backward runs.
using CommHook = std::function<std::shared_ptr<PendingReduction>(const ProcessGroup&, GradBucket&)>;

/// The built-in communication hooks (DistributedOptions::comm_hook), and the
/// pieces to build one of your own from.
namespace comm_hooks {
/// ReduceOp::Avg over ranks: the built-in reduction's result, as a hook to
/// build on.
std::shared_ptr<PendingReduction> allreduce(const ProcessGroup& group, GradBucket& bucket);
/// Divided by the world size, cast to float16, summed over ranks, cast back.
/// Halves the bytes sent; values lose float16's precision (about 1e-3
/// relative), and those past its range (65504 after the division) become
/// inf, as with PyTorch's hook: a GradScaler skips such a step, or use
/// bf16_compress.
/// Where the backend cannot sum float16 (ProcessGroup::supports: MPI), the
/// values are rounded to it and summed in the bucket's type (float32 where
/// the backend cannot sum that either): the same precision, no bytes saved.
std::shared_ptr<PendingReduction> fp16_compress(const ProcessGroup& group, GradBucket& bucket);
/// As fp16_compress with bfloat16 (wider range, about 1e-2 relative). Where
/// the backend cannot sum the 16-bit type (ProcessGroup::supports: MPI, and
/// Gloo on LibTorch 1.13), the values are rounded to it and summed in the
/// bucket's type (float32 where the backend cannot sum that either: a
/// bfloat16 model there): the same precision, no bytes saved.
std::shared_ptr<PendingReduction> bf16_compress(const ProcessGroup& group, GradBucket& bucket);
/// A reduction that is done once `work` is, with `result` as the averaged
/// bucket: for hooks built on ProcessGroup::allreduce_async.
std::shared_ptr<PendingReduction> pending(std::shared_ptr<Work> work, torch::Tensor result);
/// A reduction that is already done, for hooks that compute synchronously.
std::shared_ptr<PendingReduction> completed(torch::Tensor averaged);
} // namespace comm_hooks

} // namespace lockstep
