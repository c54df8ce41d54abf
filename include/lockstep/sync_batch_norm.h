#pragma once

/// \file
/// SyncBatchNorm: batch normalisation whose statistics are those of
/// every rank's batch together, on any backend and any device. See Note
/// [SyncBatchNorm] in src/sync_batch_norm.cpp.

#include <lockstep/process_group.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace lockstep {

class SyncBatchNormImpl;

namespace detail {
/// Numbers the SyncBatchNorm layers under `root` in module order, within the
/// wrapper's `model` number where a layer's group is the wrapper's `group`,
/// and names them by their paths, so that ranks that run two of them in
/// different orders stop with an error naming both instead of mixing their
/// statistics (Note [Collective tags]). DistributedDataParallel and
/// FullyShardedDataParallel call it on the module they wrap.
void label_sync_batch_norms(torch::nn::Module& root, const ProcessGroup& group, int64_t model);
/// The names of the parameters of the BatchNorm and SyncBatchNorm layers
/// under `root`, as root.named_parameters() gives them.
std::vector<std::string> batch_norm_parameter_names(torch::nn::Module& root);
} // namespace detail

/// Batch normalisation over input of shape (N, C, *), any number of trailing
/// dimensions. In training, the mean and variance are those of every rank's
/// batch together: one all-gather in forward and one allreduce in backward,
/// whatever N is, and ranks may hold different N, 0 included. The output, the input's
/// gradient and the running statistics then equal one torch::nn::BatchNorm
/// on the concatenated batch; each rank's weight and bias gradients are its
/// share, which DistributedDataParallel's reduction combines. In eval mode,
/// and with a group of one, it is torch::nn::BatchNorm exactly and does not
/// communicate. Its parameters and buffers have BatchNorm's names, so
/// checkpoints move between the two.
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// A layer of `options.num_features()` channels, its statistics taken over
  /// `group`'s ranks, with BatchNorm's initial values: weight 1, bias 0,
  /// running mean 0 and variance 1.
  explicit SyncBatchNormImpl(torch::nn::BatchNormOptions options, ProcessGroup group = ProcessGroup());

  /// Takes `bn`'s options, training mode, parameters and buffers, sharing
  /// them (the same tensors, as PyTorch's convert_sync_batchnorm), so that an
  /// optimizer made over `bn` keeps working.
  template <size_t D, typename Derived>
  SyncBatchNormImpl(const torch::nn::BatchNormImplBase<D, Derived>& bn, ProcessGroup group)
      : options(bn.options), group(std::move(group)) {
    adopted_ = {bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked};
    adopting_ = true;
    reset();
    train(bn.is_training());
  }

  /// Registers the parameters and buffers under BatchNorm's names and
  /// shapes, with their initial values (or, when made from a BatchNorm,
  /// that layer's tensors). num_features must be positive.
  void reset() override;
  /// Running statistics back to mean 0, variance 1, no batch seen.
  void reset_running_stats();
  /// reset_running_stats(), and weight 1, bias 0.
  void reset_parameters();

  /// Normalises `input`, of shape (N, C, *) with C = num_features: over
  /// every rank's batch in training, with the running statistics in eval mode.
  torch::Tensor forward(const torch::Tensor& input);

  /// Prints the options and the group's size:
  /// `lockstep::SyncBatchNorm(64, eps=1e-05, momentum=0.1, affine=1, track_running_stats=1, world_size=2)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options it was made with, as torch::nn::BatchNorm's.
  torch::nn::BatchNormOptions options;
  /// The ranks whose batches are normalised together.
  ProcessGroup group;
  /// The learned scale, one per channel; defined only with options.affine().
  torch::Tensor weight;
  /// The learned shift, one per channel; defined only with options.affine().
  torch::Tensor bias;
  /// The running mean, one per channel; defined only with
  /// options.track_running_stats().
  torch::Tensor running_mean;
  /// The running variance, one per channel; defined only with
  /// options.track_running_stats().
  torch::Tensor running_var;
  /// Training batches seen (a 0-dim long); defined only with
  /// options.track_running_stats().
  torch::Tensor num_batches_tracked;

 private:
  struct Adopted {
    torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  };
  Adopted adopted_;
  bool adopting_ = false;
  // Set by detail::label_sync_batch_norms; 0 and empty for a layer that no
  // wrapper has numbered.
  int64_t tag_ = 0;
  std::string path_;

  friend void detail::label_sync_batch_norms(torch::nn::Module& root, const ProcessGroup& group, int64_t model);
};

/// The module holder of SyncBatchNormImpl, made as
/// `lockstep::SyncBatchNorm bn(torch::nn::BatchNormOptions(C), group)`.
TORCH_MODULE(SyncBatchNorm);

/// Replaces the torch::nn::BatchNorm{1,2,3}d layers of `module` by
/// SyncBatchNorm layers over `group`, sharing their parameters and buffers,
/// and returns how many it replaced. LibTorch modules call their submodules
/// through typed member fields, which no function can swap from outside, so
/// only layers held in containers are replaced: entries of
/// torch::nn::Sequential (whose forward goes through AnyModule),
/// torch::nn::ModuleList and torch::nn::ModuleDict. A BatchNorm anywhere
/// else is an error naming its path, before anything is changed: declare it
/// as lockstep::SyncBatchNorm instead, or hold it in a Sequential.
size_t convert_sync_batchnorm(torch::nn::Module& module, const ProcessGroup& group);

/// For holders: `lockstep::convert_sync_batchnorm(net, group)`.
template <typename Contained>
size_t convert_sync_batchnorm(torch::nn::ModuleHolder<Contained>& holder, const ProcessGroup& group) {
  return convert_sync_batchnorm(*holder, group);
}

} // namespace lockstep
