#pragma once

// lockstep-train's data order: which training rows each rank takes for each
// batch of an epoch.
//
// Note [Data order]
// ~~~~~~~~~~~~~~~~~
// Each epoch has one order of the training rows, a permutation drawn from
// (--seed, epoch), the same on every rank. Global batch after batch is cut
// from it, and each rank takes its contiguous share of each global batch.
// So where an epoch stands is one number: the samples it has trained, over
// every rank. A run resumed from there at another --batch-size, or another
// world size, trains each of the epoch's remaining rows once, except the
// rows past a multiple of the world size at the epoch's end, which every
// epoch leaves out (below): resumed with fewer rows left than ranks, the
// epoch ends there. LibTorch's DistributedRandomSampler is not used: it
// shuffles by the epoch alone, so --seed could not change the order
// (pytorch/pytorch#73141), and each rank takes a contiguous block of the
// whole epoch, so a position in samples would depend on the world size. With
// --seed fixed, the order is also the same under DataParallel and
// DistributedDataParallel.
//
// An epoch's rows rarely fill its last batch. The rest joins the last whole
// batch instead of making a small batch of its own: the model's BatchNorm
// layers normalise each rank's rows by their own mean and variance, and on
// one row per rank those are one image's. 3 ranks, --batch-size 129 and 1293
// synthetic samples (a last batch of 1 row per rank) ended the epoch at 39.3%
// test accuracy and a test loss of 15.5, against 89.7% and 0.29 without that
// batch, although the batch's own loss was low (0.26). The next epoch's
// training loss, in training mode, was 1.09 against 0.21: the step through one
// image's statistics threw the weights off, not only the running statistics.
// So every batch has at least --batch-size rows (unless the epoch has fewer),
// and at most twice that less one; under DDP the rows past a multiple of the
// world size are left out of that last batch, so that every rank takes as
// many. Under --deterministic every batch has exactly --batch-size rows,
// cut into micro-batches of --micro-batch-size in this order, and the rows
// past the epoch's last whole batch are left out: micro-batch v of a step
// then holds the same rows at every world size.

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

/// How an epoch is cut into batches and shared out.
struct BatchPlan {
  int64_t samples = 0;    // training rows
  int64_t batch_size = 1; // global: over every rank
  int world_size = 1;
  int rank = 0;
  uint64_t seed = 1;
  bool whole_batches = false; // --deterministic: every batch --batch-size rows; the epoch's rest is left out
};

/// SplitMix64's finaliser: nearby inputs give unrelated outputs.
inline uint64_t mix_bits(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The seed of a rank's random draws (dropout) in optimizer step `step`:
/// its own per rank, so that ranks do not draw the same masks for their
/// shares of the batch, and a function of the step, so that a resumed run
/// draws what the run it resumes would have drawn.
inline uint64_t step_seed(uint64_t seed, int64_t step, int rank) {
  return mix_bits(mix_bits(mix_bits(seed) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(rank));
}

/// The rows of the batch that starts at sample `at` of the epoch, over every
/// rank: --batch-size rows, or all the rest when less than two batches
/// remain, cut down to a multiple of the world size; 0 when the epoch is
/// over (Note [Data order]).
inline int64_t batch_rows_at(const BatchPlan& plan, int64_t at) {
  const int64_t remaining = std::max<int64_t>(0, plan.samples - at);
  if (plan.whole_batches) {
    return remaining >= plan.batch_size ? plan.batch_size : 0;
  }
  const int64_t rows = remaining < 2 * plan.batch_size ? remaining : plan.batch_size;
  return rows - rows % plan.world_size;
}

/// The rows of a whole epoch over every rank, and its optimizer steps.
inline std::pair<int64_t, int64_t> epoch_extent(const BatchPlan& plan) {
  int64_t rows = 0, steps = 0;
  for (int64_t at = 0, b = batch_rows_at(plan, at); b > 0; at += b, b = batch_rows_at(plan, at)) {
    rows += b;
    ++steps;
  }
  return {rows, steps};
}

/// Why an epoch of `plan` has no optimizer step, naming the flags to change;
/// "" when it has one.
inline std::string no_step_reason(const BatchPlan& plan) {
  if (epoch_extent(plan).second > 0) {
    return "";
  }
  const std::string samples = std::to_string(plan.samples) + " training samples";
  if (plan.whole_batches) {
    return "--deterministic trains whole batches only, and the " + samples + " fill no batch of --batch-size " +
           std::to_string(plan.batch_size) + ": give a --batch-size of at most " + std::to_string(plan.samples) +
           " (a multiple of --micro-batch-size), or more samples.";
  }
  return "the " + samples + " cannot give each of the " + std::to_string(plan.world_size) +
         " ranks a row: give more samples, or run fewer ranks.";
}

// Note [The schedule after a resume]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A run resumed with another --batch-size (or over a world size that
// rounds its batches otherwise) takes another number of steps per epoch,
// and its learning-rate schedule (warmup, step epochs, the cosine's end)
// counts in those. The optimizer steps the checkpoint counted were of the
// old size: 4 steps of 128 samples are 8 of 64, and taking them as 4 would
// put the run behind in its warmup and cosine for good. So the schedule's
// step is where this run's batches would have reached the checkpoint's
// sample (steps_before), while the step counter (checkpoints, logs) goes on.

/// The optimizer steps `plan` takes before sample `at` of epoch `epoch`
/// (from 0): where a run resumed there stands in its schedule.
inline int64_t steps_before(const BatchPlan& plan, int64_t epoch, int64_t at) {
  int64_t steps = epoch * epoch_extent(plan).second;
  for (int64_t i = 0, b = batch_rows_at(plan, i); i < at && b > 0; i += b, b = batch_rows_at(plan, i)) {
    ++steps;
  }
  return steps;
}

/// The order of epoch `epoch`'s rows (Note [Data order]).
inline torch::Tensor epoch_order(const BatchPlan& plan, int64_t epoch) {
  const uint64_t seed = mix_bits(mix_bits(plan.seed) ^ static_cast<uint64_t>(epoch));
  return torch::randperm(plan.samples, at::detail::createCPUGenerator(seed), torch::kLong);
}

/// This rank's row indices of each batch of epoch `epoch` (from 0), from the
/// epoch's sample `start` on (Note [Data order]).
inline std::vector<torch::Tensor> rank_batches(const BatchPlan& plan, int64_t epoch, int64_t start) {
  const auto order = epoch_order(plan, epoch);
  std::vector<torch::Tensor> out;
  for (int64_t at = start, rows = batch_rows_at(plan, at); rows > 0; at += rows, rows = batch_rows_at(plan, at)) {
    const int64_t share = rows / plan.world_size;
    out.push_back(order.narrow(0, at + plan.rank * share, share));
  }
  return out;
}

} // namespace examples
} // namespace lockstep
