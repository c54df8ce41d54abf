#pragma once

// Internal: DistributedDataParallel's deterministic mode (Note [The same bits
// at any world size] in src/deterministic/micro_batch_step.cpp). Each rank runs its
// share of a step's micro-batches one by one, keeps each one's gradient, and
// the ranks sum them exactly, in int64.

#include <lockstep/process_group.h>

#include "deterministic/micro_batch_norms.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace lockstep {

struct DistributedOptions;

namespace detail {

class MicroBatchReducer {
 public:
  /// `params` are `module`'s, whose buffers every rank must
  /// hold alike at each step's start, and whose BatchNorms' statistics it
  /// keeps (Note [Running statistics over micro-batches]).
  MicroBatchReducer(torch::nn::Module& module, std::vector<torch::Tensor> params, ProcessGroup group,
                    const DistributedOptions& options);

  /// DistributedDataParallelImpl::backward_micro_batches.
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of);

  /// At each forward through the wrapper: refuses one that would make a
  /// gradient outside backward_micro_batches, and one whose batch (the
  /// first tensor argument's size in dim 0, -1 if none) is not
  /// micro_batch_size.
  void check_forward(int64_t batch) const;

 private:
  // Every rank's maxima, losses and buffer hashes, laid out per rank.
  struct Gathered;
  Gathered gather(int64_t step, const std::vector<std::vector<torch::Tensor>>& grads,
                  const std::vector<double>& losses, const std::vector<double>& buffer_hashes);
  void reduce(int64_t step, const std::vector<std::vector<torch::Tensor>>& grads, const Gathered& gathered);
  std::string where() const;

  std::vector<torch::Tensor> params_;
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;
  ProcessGroup group_;
  MicroBatchNorms norms_;
  int64_t micro_batches_, micro_batch_size_;
  uint64_t seed_;
  torch::Device device_;
  int64_t running_ = -1; // the micro-batch whose loss is being computed, -1 outside one
};

} // namespace detail
} // namespace lockstep
