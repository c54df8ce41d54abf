#pragma once

// Gradient reduction for DistributedDataParallel: parameters grouped into
// buckets, each bucket all-reduced as soon as its last gradient is ready,
// while backward goes on. The API follows the training step, as c10d's
// reducer does: prepare_for_backward at forward, autograd_hook per gradient,
// finalize_backward at the end of backward.

#include <lockstep/distributed.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {

/// The first bucket is small so that its allreduce starts early in backward.
constexpr int64_t kFirstBucketBytes = 1024 * 1024;
/// Cap of the other buckets, in MiB, as PyTorch's bucket_cap_mb.
constexpr double kDefaultBucketCapMb = 25.0;

/// One bucket's gradients, flattened in one tensor, as a communication hook
/// sees them.
struct GradBucket {
  size_t index = 0;
  /// The bucket's gradients, concatenated; the hook may modify it in place.
  torch::Tensor buffer;
  /// Indices of the bucket's parameters among the module's parameters.
  std::vector<size_t> parameters;
  /// "bucket 2 (5 parameters, 1.0 MiB)": names the bucket in errors.
  std::string name;
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

namespace comm_hooks {
/// Sum over ranks, then divided by the world size (the default).
std::shared_ptr<PendingReduction> allreduce(const ProcessGroup& group, GradBucket& bucket);
/// Divided by the world size, cast to float16, summed over ranks, cast back.
/// Halves the bytes sent; values lose float16's precision (about 1e-3 relative).
std::shared_ptr<PendingReduction> fp16_compress(const ProcessGroup& group, GradBucket& bucket);
/// As fp16_compress with bfloat16 (wider range, about 1e-2 relative). Gloo
/// cannot sum bfloat16, so over Gloo the values are rounded to bfloat16 and
/// summed in the bucket's type: the same precision, no bytes saved.
std::shared_ptr<PendingReduction> bf16_compress(const ProcessGroup& group, GradBucket& bucket);
/// A reduction that is already done, for hooks that compute synchronously.
std::shared_ptr<PendingReduction> completed(torch::Tensor averaged);
} // namespace comm_hooks

/// Groups parameters into buckets: in reverse order of `bytes` (reverse
/// registration order, roughly the order backward produces gradients), one
/// open bucket per `keys` value (dtype and device), closed once it reaches
/// its cap: `first_cap` for the first bucket of each key, `cap` after.
/// Returns parameter indices per bucket, in the order buckets are reduced.
std::vector<std::vector<size_t>> compute_bucket_assignment(
    const std::vector<int64_t>& bytes,
    const std::vector<std::string>& keys,
    int64_t first_cap,
    int64_t cap);

/// Options of the Reducer (DistributedOptions sets them).
struct ReducerOptions {
  TORCH_ARG(int64_t, first_bucket_bytes) = kFirstBucketBytes;
  TORCH_ARG(int64_t, bucket_bytes) = static_cast<int64_t>(kDefaultBucketCapMb * 1024 * 1024);
  TORCH_ARG(bool, find_unused_parameters) = false;
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Empty: the built-in allreduce, which gives comm_hooks::allreduce's
  /// result but divides by the world size while copying each gradient into
  /// its bucket, saving a pass over the gradients.
  TORCH_ARG(CommHook, comm_hook) = nullptr;
};

/// Registers a post hook on each parameter's gradient accumulator and reduces
/// the buckets as gradients arrive. Before backward() returns, every
/// parameter's .grad holds the average over ranks.
class Reducer {
 public:
  Reducer(std::vector<torch::Tensor> params, std::vector<std::string> names, ProcessGroup group, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Called at each forward: the next backward reduces if `sync`, and
  /// leaves .grad to accumulate locally otherwise (no_sync).
  void prepare_for_backward(bool sync);

  /// Parameter indices per bucket.
  std::vector<std::vector<size_t>> buckets() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

} // namespace lockstep
