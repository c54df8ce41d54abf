// DistributedDataParallel's join: ranks that run out of inputs at
// different times shadow the others' collectives until all are done (Note
// [Join]).

#include <lockstep/detail/distributed_core.h>
#include <lockstep/distributed_options.h>
#include <lockstep/sync_batch_norm.h>

#include <common/rank_list.h>

#include "comm/collective_fingerprint.h"
#include "ddp/reducer.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace lockstep {
namespace detail {

// Note [Join]
// ~~~~~~~~~~~
// Under join, ranks may run out of inputs at different times, as with
// PyTorch's Join. Every forward of a rank still training starts with one
// small allreduce, the round: a one-hot of who is still training, plus
// whether their step broadcasts buffers, reduces gradients and rebuilds the
// buckets. A rank that has run out sits in JoinGuard::finish(), answering
// each round with zeros and then shadowing exactly the collectives those
// ranks run: the rebuild's broadcast, the buffer broadcast (rooted at the
// first rank still training, whose buffers are current), and every bucket's
// reduction with zero gradients (through the comm hook, if there is one),
// plus plain mode's check. The ranks still training divide the sum by the
// world size, or by their own number. A round with nobody training ends it:
// the ranks that were training to the end (finish() saw that on its first
// round) hold the final parameters, and the highest of them broadcasts them,
// with the buffers, to every rank; where a rank's only reducing step came
// in the join, so that it would rebuild the buckets at its next forward and
// a rank that never stepped would not, every rank rebuilds them there by
// its order. Each round also counts the ranks' JoinOptions, which must be
// the same everywhere. throw_on_early_termination turns any round
// with some but not all ranks training into an error on every rank. The
// guard's destructor only resets the flags here: communicating from a
// destructor, while an exception unwinds, could hang.

using common::rank_list;

namespace {

// The wrappers joined on this thread (Note [Join]): a rank sits in one
// guard's finish(), shadowing that wrapper's collectives only, so a second
// wrapper joined beside it (a GAN's generator and discriminator) would meet
// the ranks still training with the wrong collectives.
thread_local int joined_wrappers = 0;

} // namespace

DistributedCore::JoinRound DistributedCore::join_round(bool training, bool reduce) {
  const int world = group_.size();
  auto round = torch::zeros({world + 5}, torch::TensorOptions().device(reducer_->device()));
  if (training) {
    round[group_.rank()] = 1;
    round[world] = sync_ ? 1 : 0;
    round[world + 1] = reduce ? 1 : 0;
    round[world + 2] = reduce && reducer_->rebuild_pending() ? 1 : 0;
  }
  round[world + 3] = join_throw_on_early_termination_ ? 1 : 0;
  round[world + 4] = join_divide_by_initial_world_size_ ? 1 : 0;
  group_.allreduce_async({round}, ReduceOp::Sum, "join's round (who is still training)")->wait();
  const auto counts = round.cpu();
  check_same_join_options(counts[world + 3].item<float>(), "throw_on_early_termination");
  check_same_join_options(counts[world + 4].item<float>(), "divide_by_initial_world_size");
  JoinRound result;
  for (int r = 0; r < world; ++r) {
    if (counts[r].item<float>() > 0) {
      result.training.push_back(r);
    }
  }
  result.sync = counts[world].item<float>() > 0;
  result.reduce = counts[world + 1].item<float>() > 0;
  result.rebuild = counts[world + 2].item<float>() > 0;
  return result;
}

// `set` of the ranks passed JoinOptions().NAME(true): all or none, or each
// rank would act on another plan (one throwing while the others go on to a
// reduction it never joins).
void DistributedCore::check_same_join_options(float set, const char* name) const {
  const int ranks = static_cast<int>(set);
  TORCH_CHECK(ranks == 0 || ranks == group_.size(), "lockstep::DistributedDataParallel::join: rank ", group_.rank(),
              ": ", ranks, " of ", group_.size(), " ranks passed JoinOptions().", name, "(true), the others false. "
              "Give every rank the same JoinOptions.");
}

// A forward under join: the round, and the divisor of this step's
// reduction; returns the rank whose buffers this step broadcasts.
int DistributedCore::join_forward_round(bool reduce) {
  const auto round = join_round(true, reduce);
  const int training = static_cast<int>(round.training.size());
  TORCH_CHECK(!join_throw_on_early_termination_ || training == group_.size(), "lockstep::DistributedDataParallel: rank ",
              group_.rank(), ": only ", rank_list(round.training), " of ", group_.size(),
              " still have inputs; the others ran out (JoinOptions().throw_on_early_termination(true) makes this an "
              "error on every rank). Give every rank the same number of batches, or join without it.");
  reducer_->set_divisor(join_divide_by_initial_world_size_ ? group_.size() : training);
  return round.training.front();
}

void DistributedCore::begin_join(bool divide_by_initial_world_size, bool throw_on_early_termination) {
  const std::string where = "lockstep::DistributedDataParallel::join: rank " + std::to_string(group_.rank()) + ": ";
  TORCH_CHECK(!joining_, where, "already joined; finish() the first JoinGuard before making another.");
  TORCH_CHECK(micro_batches_ == nullptr, where, "deterministic mode has no join: every rank runs V/W micro-batches "
              "of every step, so that the step is the same at any world size. Give every rank as many steps.");
  TORCH_CHECK(divide_by_initial_world_size || !has_comm_hook_, where, "JoinOptions().divide_by_initial_world_size(false) "
              "needs the built-in allreduce, but a comm hook is set and chooses its own divisor. Divide in the hook, "
              "or keep the default divisor.");
  for (const auto& named : module_.named_modules()) {
    TORCH_CHECK(named.value()->as<SyncBatchNormImpl>() == nullptr, where, "'", named.key(), "' is a lockstep::SyncBatchNorm, "
                "whose forward and backward communicate; a rank that has run out of inputs cannot take part in them, "
                "so join() would hang. Give every rank the same number of batches (drop or pad the last ones).");
  }
  TORCH_CHECK(joined_wrappers == 0, where, "another DistributedDataParallel is joined on this thread. A rank that runs "
              "out of inputs sits in one guard's finish(), which shadows that model's collectives only, so the ranks "
              "still training would meet it with the other model's and fail. Join one model (a GAN's generator and "
              "discriminator: wrap them in one module under one DistributedDataParallel), or give every rank the "
              "same number of batches.");
  ++joined_wrappers;
  joining_ = true;
  join_divide_by_initial_world_size_ = divide_by_initial_world_size;
  join_throw_on_early_termination_ = throw_on_early_termination;
}

void DistributedCore::end_join() {
  if (joining_) {
    --joined_wrappers;
  }
  joining_ = false;
  reducer_->set_divisor(group_.size());
}

void DistributedCore::finish_join() {
  TORCH_INTERNAL_ASSERT(joining_, "finish_join outside join");
  CollectiveTag tag(model_tag(model_, 0)); // as before_forward's, which the training ranks' rounds meet
  bool first_round = true;
  bool trained_to_the_end = false;
  while (true) {
    const auto round = join_round(false, false);
    if (round.training.empty()) {
      trained_to_the_end = first_round;
      break;
    }
    first_round = false;
    TORCH_CHECK(!join_throw_on_early_termination_, "lockstep::DistributedDataParallel: rank ", group_.rank(),
                ": this rank ran out of inputs while ", rank_list(round.training), " still have some "
                "(JoinOptions().throw_on_early_termination(true) makes this an error on every rank). Give every rank "
                "the same number of batches, or join without it.");
    const int root = round.training.front();
    if (round.rebuild) {
      reducer_->rebuild_buckets(root);
    }
    if (broadcast_buffers_ && round.sync) {
      broadcast_coalesced(group_, buffers_, root, "the broadcast of rank " + std::to_string(root) + "'s buffers",
                          /*keep_versions=*/true); // Note [Buffers synced without a version bump]
    }
    if (round.reduce) {
      // The training ranks' divisor, which chooses the allreduce's op.
      reducer_->set_divisor(join_divide_by_initial_world_size_ ? group_.size() : static_cast<int>(round.training.size()));
      reducer_->shadow_backward();
    }
  }
  // With it, the rank that would rebuild the buckets at its next forward:
  // one whose only reducing step came in the join has its gradient order
  // and waits for a rebuild that a rank with no step would never join.
  auto last = torch::full({2}, -1.0, torch::TensorOptions().dtype(torch::kFloat).device(reducer_->device()));
  last[0] = trained_to_the_end ? group_.rank() : -1;
  last[1] = reducer_->rebuild_pending() ? group_.rank() : -1;
  group_.allreduce_async({last}, ReduceOp::Max, "join's choice of the rank that trained last")->wait();
  const auto chosen = last.cpu();
  const int root = static_cast<int>(chosen[0].item<float>());
  TORCH_INTERNAL_ASSERT(root >= 0 && root < group_.size(), "no rank trained to the end");
  broadcast_coalesced(group_, synced_state(), root, "the broadcast of the final parameters from rank " + std::to_string(root));
  const int rebuild_root = static_cast<int>(chosen[1].item<float>());
  if (rebuild_root >= 0) {
    reducer_->rebuild_buckets(rebuild_root);
  }
  end_join();
}

} // namespace detail
} // namespace lockstep
