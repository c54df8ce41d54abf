#pragma once

// Internal: gradient reduction for DistributedDataParallel. Parameters are
// grouped into buckets, and each bucket is all-reduced as soon as its last
// gradient is ready, while backward goes on. The API follows the training
// step, as c10d's reducer does: prepare_for_backward at forward,
// autograd_hook per gradient, finalize_backward at the end of backward (see
// Note [Reducer state] in src/ddp/reducer_state.h).

#include <lockstep/process_group.h>

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {

struct DistributedOptions;

namespace detail {

/// Groups parameters into buckets: in `order`, the order their gradients are
/// expected to become ready (empty: reverse registration order, roughly the
/// order backward produces them before anything was measured), one open
/// bucket per `keys` value (dtype and device), closed once it reaches its
/// cap: `first_cap` for the first bucket of each key, `cap` after. Returns
/// parameter indices per bucket, in the order buckets are reduced.
std::vector<std::vector<size_t>> compute_bucket_assignment(
    const std::vector<int64_t>& bytes,
    const std::vector<std::string>& keys,
    int64_t first_cap,
    int64_t cap,
    const std::vector<size_t>& order = {});

/// Registers a post hook on each parameter's gradient accumulator and reduces
/// the buckets as gradients arrive. Before backward() returns, every
/// parameter's .grad holds the average over ranks.
class Reducer {
 public:
  Reducer(
      std::vector<torch::Tensor> params,
      std::vector<std::string> names,
      ProcessGroup group,
      const DistributedOptions& options,
      int64_t model = 0); // the wrapper's number in its collectives' tags (Note [Collective tags])
  ~Reducer();

  /// Throws, naming the first of `params` that a live Reducer already
  /// reduces: a second DistributedDataParallel over the same module (or one
  /// sharing its parameters) would reduce its gradients twice.
  static void check_not_reduced(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names, int rank);
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Called at each forward: the next backward reduces if `sync`, and
  /// leaves .grad to accumulate locally otherwise (no_sync).
  void prepare_for_backward(bool sync);
  /// Throws if the last backward that reached this reducer stopped before
  /// its end (an exception inside backward): its gradients were never
  /// averaged, and a new step would silently average nothing.
  void check_last_backward_finished() const;
  /// Throws, naming the parameter, if one lost the gradient hook this
  /// reducer put on it: a torch::load into the wrapper, or a to() of another
  /// dtype or device, after wrapping gives it a new gradient accumulator,
  /// whose gradient nothing averages (Note [A parameter replaced after
  /// wrapping]).
  void check_hooks_attached() const;

  /// Whether a reducing backward has recorded the order its gradients became
  /// ready in, and the buckets are still to be rebuilt in that order.
  bool rebuild_pending() const;
  /// Rebuilds the buckets in `root`'s recorded order, which a broadcast
  /// gives every rank: ranks never disagree on buckets. A collective.
  void rebuild_buckets(int root);
  /// For a rank that has joined (JoinGuard::finish): the collectives of one
  /// reducing backward, every gradient a zero, as the other ranks run theirs.
  void shadow_backward();
  /// What the built-in allreduce divides the sum by, from the next backward
  /// on: the world size, or the ranks still training under join.
  void set_divisor(int64_t divisor);

  /// Parameter indices per bucket.
  std::vector<std::vector<size_t>> buckets() const;
  /// Where the gradients live, and so where small collectives' tensors go.
  torch::Device device() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

} // namespace detail
} // namespace lockstep
