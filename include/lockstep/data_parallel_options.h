#pragma once

/// \file
/// Options of lockstep::DataParallel (data_parallel.h), with fluent setters,
/// as the C++ frontend keeps module options apart from modules.

#include <lockstep/scatter_gather.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace lockstep {

/// What happens to replicas' buffers (BatchNorm running statistics).
enum class BufferSync {
  /// Before each forward, every replica takes the wrapped module's buffers;
  /// replica 0's buffers share the wrapped module's storage, so its updates
  /// are the ones kept. This is PyTorch's behaviour.
  Broadcast,
  /// As Broadcast, and after each forward in training mode the wrapped module's
  /// floating-point buffers become the average of all replicas' buffers,
  /// weighted by their share of the batch. For BatchNorm's running mean this is
  /// exactly the bare module's value.
  Average,
  /// Replicas keep the buffers they update in training; nothing is copied.
  /// Replica 0's are the wrapped module's. A module in eval mode updates
  /// none, and there every replica takes the wrapped module's, so that an
  /// evaluation answers every row as the module would.
  Off,
};

/// Options of lockstep::DataParallel, with fluent setters.
struct DataParallelOptions {
  /// Devices, one replica each; replica 0 runs on devices[0], where the
  /// wrapped module must be. The same device may repeat. Empty: every visible
  /// GPU, or without one default_devices() (kDefaultCpuReplicas CPU replicas).
  TORCH_ARG(std::vector<torch::Device>, devices) = {};
  /// Where gathered outputs go. Default: devices[0].
  TORCH_ARG(c10::optional<torch::Device>, output_device) = c10::nullopt;
  /// The dimension inputs are split along and outputs concatenated along.
  TORCH_ARG(int64_t, dim) = 0;
  /// Share of the batch per device, one positive weight each. Empty: even.
  TORCH_ARG(std::vector<double>, weights) = {};
  /// How 0-dim outputs are combined.
  TORCH_ARG(ScalarGather, scalar_outputs) = ScalarGather::Stack;
  /// What happens to buffers.
  TORCH_ARG(BufferSync, buffers) = BufferSync::Broadcast;
  /// Intra-op threads of each CPU replica. 0: the caller's thread count split
  /// evenly between the CPU replicas (at least one each).
  TORCH_ARG(int64_t, intra_op_threads) = 0;
  /// Deterministic mode, as DistributedOptions::deterministic: the same
  /// parameters, to the bit, as DistributedDataParallel's and
  /// FullyShardedDataParallel's deterministic modes give at any world size.
  /// Gradients then come only from DataParallelImpl::backward_micro_batches,
  /// which runs the micro-batches one after another through the wrapped
  /// module on devices[0], as one rank of DistributedDataParallel would:
  /// the replicas, which share the process's random generator, run only
  /// forwards without autograd (evaluation).
  TORCH_ARG(bool, deterministic) = false;
  /// Deterministic mode: V, the number of micro-batches in a step's global batch.
  TORCH_ARG(int64_t, micro_batches) = 0;
  /// Deterministic mode: the samples in each micro-batch, which forward checks
  /// on its first tensor argument (dim 0); 0 checks nothing.
  TORCH_ARG(int64_t, micro_batch_size) = 0;
  /// Deterministic mode: seeds each micro-batch's random numbers with the
  /// step and the micro-batch's index (DistributedOptions::seed).
  TORCH_ARG(uint64_t, seed) = 0;
};

/// CPU replicas used when there is no GPU: one, which is the bare module with
/// no overhead. On the 2-core machines we measure on, two CPU replicas ran at
/// 0.81x-0.83x of the bare module using both cores as intra-op threads on an
/// MLP, and 0.99x-1.33x on a CNN (docs/performance.md): a loss as often as a
/// gain, so CPU replicas are opt-in, through devices().
constexpr int64_t kDefaultCpuReplicas = 1;

/// Every visible CUDA device, or kDefaultCpuReplicas CPU devices without one.
std::vector<torch::Device> default_devices();

} // namespace lockstep
