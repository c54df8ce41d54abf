#pragma once

// Internal: BatchNorm's running statistics in DistributedDataParallel's
// deterministic mode (Note [Running statistics over micro-batches] in
// src/deterministic/micro_batch_norms.cpp): each micro-batch's update is recorded
// alone, and every rank replays all of a step's updates in micro-batch order.

#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

class MicroBatchNorms {
 public:
  /// Finds `module`'s BatchNorm layers that track running statistics.
  /// Refuses SyncBatchNorm (its forward communicates) and a cumulative
  /// average (momentum unset), naming the layer.
  MicroBatchNorms(torch::nn::Module& module, const std::string& where);

  /// As a step starts: keeps the statistics, which restore() gives back.
  void start_step();
  /// Before each micro-batch: zeroes the statistics of the layers in
  /// training mode, so that forward leaves its own update in them; the
  /// others get the step's first statistics back, which they normalise with.
  void begin();
  /// After micro-batch k: records its update, a flag, the momentum and the
  /// two statistics per layer; throws, naming the layer, if one was updated more
  /// than once.
  void end(int64_t k);
  /// Elements that end(k) recorded for one micro-batch.
  int64_t recorded_per_micro_batch() const {
    return per_micro_batch_;
  }
  /// This rank's records, micro-batch after micro-batch, as doubles, for
  /// `share` micro-batches: zeros for those a failed step did not run.
  std::vector<double> recorded(int64_t share) const;
  /// Sets every layer's statistics back to the step's start.
  void restore();
  /// Whether `tensor` is a statistic these records keep.
  bool tracks(const torch::Tensor& tensor) const;
  /// Sets every layer's statistics to the step's start with every
  /// micro-batch's update applied in order: `records` holds each rank's
  /// recorded(), in rank order.
  void replay(const std::vector<const double*>& records, int64_t share);

 private:
  struct Norm {
    std::string name;
    const torch::nn::Module* module;
    torch::Tensor mean, var, count;
    const torch::nn::BatchNormOptions* options; // the layer's own: momentum is read at each micro-batch
  };
  std::string where_;
  std::vector<Norm> norms_;
  int64_t per_micro_batch_ = 0;
  std::vector<torch::Tensor> start_mean_, start_var_, start_count_;
  std::vector<std::vector<double>> recorded_; // per micro-batch
};

} // namespace detail
} // namespace lockstep
