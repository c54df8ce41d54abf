#pragma once

// Internal: everything of DataParallel that does not depend on the module's
// type, one method per stage of Note [DataParallel step] (data_parallel.h),
// implemented in src/dp/data_parallel.cpp in that order. The autograd node that
// stage 5 attaches is src/dp/parallel_backward.{h,cpp}.

#include <lockstep/data_parallel_options.h>
#include <lockstep/detail/scatter_gather.h>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

class WorkerPool;
class MicroBatchStep;

/// DataParallel's deterministic mode (src/dp/deterministic.cpp): the
/// micro-batches through the wrapped module, summed as one rank of
/// DistributedDataParallel sums them.
class DataParallelDeterminism {
 public:
  DataParallelDeterminism(torch::nn::Module& module, const DataParallelOptions& options);
  ~DataParallelDeterminism();
  /// DataParallelImpl::backward_micro_batches.
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of);
  /// Whether a forward with this `batch` (-1: no tensor) runs the wrapped
  /// module alone: one with autograd on, which must come from inside
  /// backward_micro_batches (else an error).
  bool forward_alone(int64_t batch) const;

 private:
  std::unique_ptr<MicroBatchStep> step_;
  std::vector<torch::Tensor> params_;
};

/// Fills in default devices, gives bare CUDA devices an index, and checks
/// every option, before anything is cloned.
DataParallelOptions resolve_options(DataParallelOptions options);

/// Throws, naming the first parameter or buffer of `module` not on `first`.
void check_module_on(const torch::nn::Module& module, torch::Device first);

/// Throws, naming a SyncBatchNorm over several ranks, which `replicas`
/// replicas on threads cannot share (src/sync_batch_norm.cpp).
void check_replicable(const torch::nn::Module& module, size_t replicas);

/// Stage 1's result: the call's rows and which replicas run.
struct Plan {
  int64_t batch = 0;
  std::vector<size_t> used; // replicas with at least one row, ascending
  std::vector<int64_t> sizes; // per replica, 0 for unused ones
  std::vector<int64_t> offsets; // per replica
};

/// Stage 3's record of the inputs that need a gradient.
struct StepInputs {
  std::vector<std::vector<torch::Tensor>> leaves; // per replica
  std::vector<InputSource> sources;
};

/// How one gathered output was made from the replicas' outputs, so that its
/// gradient can be cut back into the replicas' pieces.
struct OutputSpec {
  enum class Kind { Cat, Stack, Weighted } kind = Kind::Cat;
  int64_t dim = 0;
  std::vector<int64_t> sizes; // Cat: per running replica, along dim
  std::vector<double> weights; // Weighted: per running replica
};

/// Stage 4's result, one entry per flattened output tensor.
struct Gathered {
  std::vector<torch::Tensor> tensors;
  std::vector<size_t> differentiable; // indices of the tensors that get ParallelBackward
  std::vector<OutputSpec> specs; // per entry of `differentiable`
};

class DataParallelCore {
 public:
  /// `source` is the wrapped module; `replicas` its clones, one per device of
  /// `options.devices()`, or just `source` when it runs alone (see
  /// Note [Replica 0]); `options` come from resolve_options().
  DataParallelCore(
      std::shared_ptr<torch::nn::Module> source,
      std::vector<std::shared_ptr<torch::nn::Module>> replicas,
      DataParallelOptions options);

  /// Whether forward runs the wrapped module itself: one device, outputs on it.
  static bool runs_alone(const DataParallelOptions& options) {
    return options.devices().size() == 1 && options.output_device().value_or(options.devices()[0]) == options.devices()[0];
  }

  const DataParallelOptions& options() const {
    return options_;
  }

  /// While alive, a forward runs: another thread's forward meanwhile is an
  /// error, since the replicas hold one step's parameters, buffers and
  /// inputs at a time.
  class ForwardGuard {
   public:
    explicit ForwardGuard(std::atomic<bool>& running);
    ~ForwardGuard() {
      running_ = false;
    }
    ForwardGuard(const ForwardGuard&) = delete;
    ForwardGuard& operator=(const ForwardGuard&) = delete;

   private:
    std::atomic<bool>& running_;
  };
  std::atomic<bool>& forward_running() {
    return forward_running_;
  }
  size_t size() const {
    return replicas_.size();
  }

  /// Stage 1: the batch size all split tensors agree on, cut into chunks.
  Plan plan(const SplitSites& sites) const;

  /// Stage 2: device checks, params and buffers onto the replicas that run.
  void prepare_forward(const Plan& plan);

  /// Stage 3: fn(replica, scatter) on each running replica's worker. Throws a
  /// c10::Error naming the replica and device if any of them threw.
  StepInputs apply(const Plan& plan, const std::function<void(size_t, ReplicaScatter&)>& fn);

  /// Stage 4: one flat tensor list per running replica, gathered into one
  /// list on the output device.
  Gathered gather(const Plan& plan, const std::vector<std::vector<torch::Tensor>>& flat) const;

  /// After stage 4, with BufferSync::Average in training: the wrapped module's
  /// floating-point buffers become the replicas', weighted by rows. With
  /// Broadcast, when replica 0 got no rows: the first used replica's.
  void average_buffers(const Plan& plan);

  /// Stage 5, prepared: gives the differentiable gathered tensors one
  /// ParallelBackward node (src/dp/parallel_backward.h).
  void attach_backward(
      const Plan& plan,
      const std::vector<std::vector<torch::Tensor>>& flat,
      Gathered& gathered,
      StepInputs&& inputs);

  /// fn(replica) on every replica's worker, or on the caller with one replica.
  void map_replicas(const std::function<void(size_t)>& fn);

  /// Mirrors train()/eval() and dtype changes of the wrapped module.
  void train(bool on);
  void to_dtype(torch::Dtype dtype, bool non_blocking);

 private:
  torch::Device output_device() const;
  void check_on_first_device() const;
  void check_unchanged() const;
  void check_shared_unchanged(const Plan& plan, const std::vector<ReplicaScatter>& scatters) const;
  void mirror_modes(size_t replica);
  void sync_params(size_t replica);
  void sync_buffers(size_t replica);
  void alias_replica0_buffers();

  std::shared_ptr<torch::nn::Module> source_; // the wrapped module
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
  std::vector<std::shared_ptr<torch::nn::Module>> source_modules_; // pre-order, the root first
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>> replica_modules_; // [replica], as source_modules_
  DataParallelOptions options_;
  std::vector<std::string> param_names_;
  std::vector<std::string> buffer_names_;
  std::vector<torch::Tensor> source_params_;
  std::vector<torch::Tensor> source_buffers_;
  std::vector<size_t> buffer_owners_; // [buffer]: its module's index in source_modules_
  std::vector<std::vector<torch::Tensor>> params_; // [replica][param]
  std::vector<std::vector<torch::Tensor>> buffers_; // [replica][buffer]
  std::shared_ptr<WorkerPool> pool_; // shared with pending backward nodes
  std::atomic<bool> forward_running_{false};
};

} // namespace detail
} // namespace lockstep
