#pragma once

/// \file
/// The options of lockstep::FullyShardedDataParallel: what is sharded, the
/// units, and mixed precision.

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lockstep {

/// What is split over the ranks, with PyTorch's names.
enum class ShardingStrategy {
  /// ZeRO-3: parameters, gradients and optimizer state. Parameters are
  /// gathered for forward, freed after it, gathered again for backward.
  FullShard,
  /// ZeRO-2: gradients and optimizer state. Parameters stay whole from
  /// forward to the end of backward.
  ShardGradOp,
  /// Nothing: each rank holds everything and gradients are averaged, as DDP.
  NoShard,
};

/// Options of lockstep::FullyShardedDataParallel, with fluent setters.
struct ShardingOptions {
  /// What is split over the ranks. Default: FullShard.
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::FullShard;
  /// Dotted paths of the submodules that are units ("encoder", "layers.3"),
  /// as PyTorch FSDP's nested (auto-wrapped) modules. Empty (the default):
  /// each direct child of the wrapped module. The root unit ("", which may
  /// be named too) keeps the parameters no unit claims; {""} alone makes
  /// it the only unit.
  TORCH_ARG(std::vector<std::string>, units) = {};
  /// FullShard: free each unit's gathered parameters after forward (true)
  /// or keep them until the end of backward (false).
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Each unit other than the root runs its forward as a
  /// lockstep::checkpoint segment, keeping no activations inside it for
  /// backward: the unit's module must derive from lockstep::Checkpointable
  /// (include/lockstep/activation_checkpoint.h), which the wrapper switches
  /// on. A unit that does not, or no unit besides the root, is an error at
  /// construction. The gradients are the same bits as without it.
  TORCH_ARG(bool, activation_checkpointing) = false;
  /// Mixed precision: the dtype floating-point parameters are gathered in,
  /// and so forward and backward compute in (torch::kBFloat16 halves every
  /// all-gather). The shards, model->parameters(), the optimizer and its
  /// state stay in the parameters' own dtype: fp32 master weights.
  /// Floating-point tensor arguments of forward are cast to it, also inside
  /// a std::vector, c10::optional, std::pair or std::tuple argument; outputs
  /// stay in it. A BatchNorm's (or SyncBatchNorm's) parameters keep their own
  /// dtype, as PyTorch's FSDP leaves BatchNorm out of its mixed precision.
  /// summon_full_params() gives the parameters in their own dtype.
  /// Unset: the parameters' own dtype. FullShard and ShardGradOp only.
  TORCH_ARG(std::optional<torch::ScalarType>, param_dtype) = std::nullopt;
  /// The dtype gradients are reduce-scattered (averaged) in before they are
  /// added to the shards' gradients. Unset: param_dtype, else the
  /// parameters' own dtype. torch::kFloat beside a bf16 param_dtype keeps
  /// the average exact to fp32 at twice the reduce-scatter's bytes. A
  /// BatchNorm's gradients are reduced in their own dtype.
  TORCH_ARG(std::optional<torch::ScalarType>, reduce_dtype) = std::nullopt;
  /// Deterministic mode, as DistributedOptions::deterministic: the same
  /// parameters, to the bit, at every world size that divides
  /// micro_batches, under every strategy, and as DistributedDataParallel's
  /// deterministic mode gives. Gradients then come only from
  /// FullyShardedDataParallelImpl::backward_micro_batches, and
  /// clip_grad_norm_ computes the norm as torch::nn::utils::clip_grad_norm_
  /// does on the whole gradient. reduce_dtype then has no effect: the sum is
  /// exact.
  TORCH_ARG(bool, deterministic) = false;
  /// Deterministic mode: V, the number of micro-batches in a step's global
  /// batch. Each of W ranks runs V/W of them; W must divide V.
  TORCH_ARG(int64_t, micro_batches) = 0;
  /// Deterministic mode: the samples in each micro-batch, which forward checks
  /// on its first tensor argument (dim 0); 0 checks nothing.
  TORCH_ARG(int64_t, micro_batch_size) = 0;
  /// Deterministic mode: seeds each micro-batch's random numbers with the
  /// step and the micro-batch's index (DistributedOptions::seed).
  TORCH_ARG(uint64_t, seed) = 0;
};

} // namespace lockstep
