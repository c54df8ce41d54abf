#pragma once

// Internal: stage 5 of Note [DataParallel step], the autograd node that runs
// every replica's backward in parallel.

#include "dp/worker_pool.h"

#include <lockstep/detail/data_parallel_core.h>

#include <torch/csrc/autograd/function.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// What a replica's backward needs: its differentiable outputs (aligned with
/// the node's inputs, undefined where that replica's output needs no
/// gradient), its parameters that need one, and its input leaves.
struct ReplicaGraph {
  size_t replica = 0;
  torch::Device device{torch::kCPU};
  std::vector<torch::Tensor> outputs;
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> leaves;
};

/// How an input that needs a gradient was given to the replicas.
struct InputMeta {
  bool split = true;
  int64_t dim = 0;
  std::vector<int64_t> sizes; // per running replica: rows of its chunk
  torch::TensorOptions options;
  std::vector<int64_t> shape;
};

/// Everything one ParallelBackward needs, assembled by
/// DataParallelCore::attach_backward.
struct BackwardPlan {
  std::shared_ptr<WorkerPool> pool;
  std::vector<torch::Device> devices; // per replica, running or not
  std::vector<OutputSpec> outputs; // per node input: a differentiable gathered output
  std::vector<ReplicaGraph> replicas; // per running replica
  std::vector<torch::Tensor> params; // the wrapped module's, needing grad: the first next edges
  std::vector<InputMeta> inputs; // the caller's inputs needing grad: the next edges after them
};

/// The grad_fn of a replica's parameter, and of its buffers that require a
/// gradient: passes the gradient on to the wrapped module's tensor, moved to
/// its device (Note [Replica parameters] in src/dp/data_parallel.cpp).
class ReplicaToModule : public torch::autograd::Node {
 public:
  ReplicaToModule(const torch::Tensor& replica, const torch::Tensor& module);

  std::string name() const override {
    return "lockstep::ReplicaToModule";
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  /// Whether this node still fits the pair: same shape, dtype and devices,
  /// and the module's tensor still has the same gradient accumulator.
  bool links(const torch::Tensor& replica, const torch::Tensor& module) const;

 private:
  std::vector<int64_t> sizes_;
  caffe2::TypeMeta dtype_;
  torch::Device replica_device_;
  torch::Device module_device_;
};

/// Makes `replica` a non-leaf whose gradient flows to `module` (or a plain
/// leaf without gradient when `module` needs none); reuses the node already
/// there when it still fits.
void link_to_module(torch::Tensor& replica, const torch::Tensor& module);

/// Which of `workers` workers sums each parameter's gradients: the largest
/// first, each to the worker with the fewest elements so far, so that one
/// large layer does not leave one worker summing while the others wait.
std::vector<size_t> assign_sums(const std::vector<int64_t>& numels, size_t workers);

/// Splits the gradient of the gathered outputs between the replicas, runs
/// their backward on their workers (CPU) or here (GPU), and returns the summed
/// parameter gradients and the input gradients to the engine.
class ParallelBackward : public torch::autograd::Node {
 public:
  explicit ParallelBackward(BackwardPlan plan) : plan_(std::move(plan)) {}

  std::string name() const override {
    return "lockstep::ParallelBackward";
  }
  void release_variables() override;
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;

 private:
  torch::Tensor piece(const torch::Tensor& grad, const OutputSpec& spec, size_t g) const;
  torch::autograd::variable_list combine(
      std::vector<torch::autograd::variable_list>& results,
      const std::vector<size_t>& workers) const;
  void sum_param_gradients(
      std::vector<torch::autograd::variable_list>& results,
      const std::vector<size_t>& workers,
      torch::autograd::variable_list& out) const;
  torch::Tensor input_gradient(const std::vector<torch::autograd::variable_list>& results, size_t s) const;

  BackwardPlan plan_;
  bool released_ = false;
};

} // namespace detail
} // namespace lockstep
