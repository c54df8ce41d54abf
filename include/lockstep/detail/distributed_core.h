#pragma once

// Internal: the part of DistributedDataParallel that does not depend on the
// module's type (src/ddp/distributed_data_parallel.cpp).

#include <lockstep/process_group.h>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

struct DistributedOptions;

namespace detail {

class MicroBatchStep;
class Reducer;

/// The part of DistributedDataParallel that does not depend on the module's
/// type: checks, broadcasts and the reducer.
class DistributedCore {
 public:
  DistributedCore(torch::nn::Module& module, ProcessGroup group, const DistributedOptions& options);
  ~DistributedCore();

  /// Buffers from rank 0 if asked, and the reducer told what the next
  /// backward must do. `batch`: the first tensor argument's size in dim 0,
  /// -1 if none (deterministic mode checks it).
  void before_forward(int64_t batch = -1);
  /// DistributedDataParallelImpl::backward_micro_batches.
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of);

  const ProcessGroup& group() const {
    return group_;
  }
  /// The reducer's buckets (DistributedDataParallelImpl::buckets).
  std::vector<std::vector<size_t>> buckets() const;
  /// False inside no_sync(): forwards then make their backward skip reduction.
  bool sync() const {
    return sync_;
  }
  void set_sync(bool sync) {
    sync_ = sync;
  }

  /// JoinGuard's: see Note [Join] in src/ddp/join.cpp.
  void begin_join(bool divide_by_initial_world_size, bool throw_on_early_termination);
  void finish_join();
  void end_join();

 private:
  // One round of join's collective: who still trains, and what their step does.
  struct JoinRound {
    std::vector<int> training; // ranks, ascending
    bool sync = false; // their forward broadcasts buffers
    bool reduce = false; // their backward reduces gradients
    bool rebuild = false; // their forward rebuilds the buckets
  };
  JoinRound join_round(bool training, bool reduce);
  int join_forward_round(bool reduce);
  void check_same_join_options(float set, const char* name) const;
  // Each shared parameter or buffer once.
  std::vector<torch::Tensor> synced_state() const;
  // A parameter frozen at wrapping has no hook: unfreezing it later would
  // leave its gradient local to each rank.
  void check_still_frozen() const;
  void make_deterministic(std::vector<torch::Tensor> params, const DistributedOptions& options);

  torch::nn::Module& module_;
  bool sync_ = true;
  ProcessGroup group_;
  int64_t model_ = 0; // this wrapper's number in its collectives' tags
  bool broadcast_buffers_;
  bool has_comm_hook_;
  bool joining_ = false;
  bool join_divide_by_initial_world_size_ = true;
  bool join_throw_on_early_termination_ = false;
  std::vector<torch::Tensor> buffers_;
  std::vector<std::pair<std::string, torch::Tensor>> frozen_; // name, parameter
  std::unique_ptr<Reducer> reducer_; // null in deterministic mode
  // Deterministic mode's step and trainable parameters (src/ddp/deterministic.cpp), null otherwise.
  std::unique_ptr<MicroBatchStep> micro_batches_;
  std::vector<torch::Tensor> exact_params_;
};

/// Checks that every rank has the same parameters (count, names, shapes,
/// dtypes, in order) and the same `options` (a description of what sets the
/// collectives); a mismatch throws on every rank, naming the first
/// difference and what rank 0 has. Returns the wrapper's model number, rank
/// 0's proposal (Note [Collective tags] in src/comm/collective_fingerprint.cpp).
int64_t verify_same_parameters(
    const ProcessGroup& group,
    const std::vector<std::string>& names,
    const std::vector<torch::Tensor>& params,
    const std::string& options);

/// Copies root's `tensors` into every rank's, one collective per dtype and
/// device; with keep_versions, without moving their version counters (Note
/// [Buffers synced without a version bump]).
void broadcast_coalesced(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors, int root,
                         const std::string& what, bool keep_versions = false);

} // namespace detail

} // namespace lockstep
