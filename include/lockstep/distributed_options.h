#pragma once

/// \file
/// The options of lockstep::DistributedDataParallel and of its join().

#include <lockstep/comm_hooks.h>

#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace lockstep {

/// Cap of the first bucket: small, so that its allreduce starts early in backward.
constexpr int64_t kFirstBucketBytes = 1024 * 1024;
/// Cap of the other buckets: PyTorch's default bucket_cap_mb, 25 MiB.
constexpr int64_t kDefaultBucketBytes = 25 * 1024 * 1024;

/// Options of lockstep::DistributedDataParallel, with fluent setters.
struct DistributedOptions {
  /// Cap of each bucket after the first, in bytes.
  TORCH_ARG(int64_t, bucket_bytes) = kDefaultBucketBytes;
  /// Cap of the first bucket, in bytes. A smaller bucket_bytes caps it too.
  TORCH_ARG(int64_t, first_bucket_bytes) = kFirstBucketBytes;
  /// Allow parameters that get no gradient in some iterations; they are
  /// reduced as zeros. Without it such parameters are an error on every rank.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Copy rank 0's buffers (BatchNorm statistics) to every rank at wrapping
  /// and before each forward (at join's end, the last trainer's); false
  /// leaves each rank's buffers its own, as PyTorch's.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Make each .grad a view into its bucket: no copy in or out, and no
  /// gradient-sized memory besides the buckets. A .grad keeps its
  /// parameter's strides (channels-last) except for a parameter whose
  /// dimension 0 is not outermost in memory (a transposed matrix), whose
  /// .grad is contiguous. Without it, .grad holds PyTorch's values and stays
  /// any tensor you hold; on the CPU a .grad that nothing else holds (the
  /// one backward makes after zero_grad() set it to none) still becomes its
  /// bucket slot, and a slot you keep keeps its values through the next
  /// backward (Note [Gradients that are bucket slots] in
  /// src/ddp/reducer_slots.cpp).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// How a bucket is reduced: comm_hooks::allreduce, fp16_compress,
  /// bf16_compress, or your own. Empty (the default): the built-in allreduce,
  /// comm_hooks::allreduce's result with the division by the world size
  /// fused into the copy of each gradient into its bucket.
  TORCH_ARG(CommHook, comm_hook) = nullptr;
  /// Promise that every iteration gives gradients to the same parameters:
  /// the first reducing backward records which ones get none, and later
  /// ones skip the search for them and plain mode's check collective. A
  /// broken promise is an error on every rank naming the parameter (Note
  /// [Static graph] in src/ddp/reducer_state.h).
  TORCH_ARG(bool, static_graph) = false;
  /// After the first reducing backward, rebuild the buckets in the order its
  /// gradients became ready, as c10d does; false keeps reverse registration
  /// order (Note [Rebuilding buckets] in src/ddp/reducer_state.h).
  TORCH_ARG(bool, rebuild_buckets) = true;
  /// Deterministic mode: the same gradients, to the bit, at every world size
  /// that divides micro_batches. Gradients then come only from
  /// DistributedDataParallelImpl::backward_micro_batches, which runs each
  /// micro-batch alone and sums them exactly (Note [The same bits at any
  /// world size] in src/deterministic/micro_batch_step.cpp). On a GPU it turns on
  /// the process's deterministic algorithms
  /// (at::globalContext().setDeterministicAlgorithms), and sets
  /// CUBLAS_WORKSPACE_CONFIG=:4096:8 unless it is set.
  TORCH_ARG(bool, deterministic) = false;
  /// Deterministic mode: V, the number of micro-batches in a step's global
  /// batch. Each of W ranks runs V/W of them; W must divide V.
  TORCH_ARG(int64_t, micro_batches) = 0;
  /// Deterministic mode: the samples in each micro-batch, which forward checks
  /// on its first tensor argument (dim 0); 0 checks nothing.
  TORCH_ARG(int64_t, micro_batch_size) = 0;
  /// Deterministic mode: seeds the random numbers of each micro-batch's
  /// forward and backward (dropout), with the step and the micro-batch's
  /// index, so that they are the same on whichever rank it runs.
  TORCH_ARG(uint64_t, seed) = 0;

 public: // TORCH_ARG leaves the rest private
  /// bucket_bytes in MiB, as PyTorch's bucket_cap_mb; at least one byte.
  DistributedOptions& bucket_cap_mb(double mib) {
    // Beyond 2^43 MiB the bytes would not fit bucket_bytes' 64 bits.
    TORCH_CHECK(std::isfinite(mib) && mib > 0 && mib <= 8.0e12, "lockstep::DistributedOptions: bucket_cap_mb must be "
                "a finite number of MiB above 0 (at most 8e12), but got ", mib, ".");
    bucket_bytes_ = std::max<int64_t>(1, static_cast<int64_t>(mib * 1024 * 1024));
    return *this;
  }
};

/// Options of DistributedDataParallelImpl::join, as PyTorch's Join.
struct JoinOptions {
  /// Divide the summed gradients by the world size even when some ranks have
  /// joined and contribute zeros (PyTorch's default); false: by the number of
  /// ranks still training. Needs the built-in allreduce: a comm hook chooses
  /// its own divisor.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
  /// Make every rank throw as soon as any rank runs out of inputs, instead
  /// of shadowing it.
  TORCH_ARG(bool, throw_on_early_termination) = false;
};

} // namespace lockstep
