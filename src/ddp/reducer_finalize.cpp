// The end of a reducing backward (Note [Reducer state] in
// src/ddp/reducer_state.h): what got no gradient, the waits, the copies back into
// .grad, and the errors every rank raises together.

#include "comm/collective_fingerprint.h"
#include "ddp/reducer_state.h"

#include <lockstep/timeline.h>

#include <torch/torch.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace lockstep {
namespace detail {

void Reducer::State::finalize_backward() {
  finalize_queued = false;
  phase = Phase::Idle;
  torch::NoGradGuard no_grad;
  CollectiveTag tag(model_tag(model, 0)); // Note [Collective tags]: the small collectives; each bucket has its own
  // Note [Timeline]: from the first hook to the end of this callback; a
  // shadow backward has no hook, and no span.
  const timeline::Span backward = shadowing ? timeline::Span() : std::move(backward_span);

  const std::vector<size_t> unused = record_unused();
  had_unused = !unused.empty() && !shadowing;
  launch_remaining_buckets(unused);

  // Small collectives beside the buckets, launched in the same order on
  // every rank: static_graph's flag, or plain mode's check, where a hook
  // reduces the buckets (Note [Static graph]), and which parameters each rank
  // used (Note [Unused parameters]).
  SmallCollective static_flag, used_flags, unused_ranks;
  if (options.static_graph() && !flag_in_last_bucket()) {
    static_flag.launch(group, torch::full({1}, surprised() ? 1.0f : 0.0f, torch::TensorOptions().device(params[0].device())),
                       "static_graph's check");
  }
  if (reduces_used_flags()) {
    std::vector<float> flags(params.size(), 0.0f);
    for (size_t i = 0; i < params.size() && !shadowing; ++i) {
      flags[i] = used_since_sync[i] ? 1.0f : 0.0f;
    }
    used_flags.launch(group, torch::tensor(flags).to(params[0].device()), "the allreduce of which parameters each rank used");
  }
  used_since_sync.assign(params.size(), 0);
  if (checks_unused() && !flag_in_last_bucket()) {
    unused_ranks.launch(group, torch::full({1}, had_unused ? 1.0f : 0.0f, torch::TensorOptions().device(params[0].device())),
                        "the check for parameters without gradients");
  }

  // Plain mode's reductions need nothing but themselves to be copied out:
  // each is, while the next is still on its way.
  const bool copy_each = !options.comm_hook() && !options.static_graph() && !reduces_used_flags();
  const auto reduced = wait_buckets(copy_each);
  const double flag = flag_in_last_bucket() ? reduced.back()[buckets.back().numel].item<double>()
                      : static_flag.work     ? static_flag.result().item<float>()
                      : unused_ranks.work    ? unused_ranks.result().item<float>()
                                             : 0.0;
  if (options.static_graph() && flag != 0) {
    throw_static_graph_error();
  }
  if (used_flags.work) {
    record_global_unused(used_flags.result());
  }
  if (!copy_each) {
    for (size_t b = 0; b < buckets.size(); ++b) {
      copy_out(b, reduced[b]);
    }
  }
  if (checks_unused()) {
    check_unused(unused, static_cast<int>(flag));
  }
}

// What got no gradient goes in as it is (zeros if nothing), so that every
// bucket is reduced on every rank in the same order: nobody waits for a
// collective that never comes.
void Reducer::State::launch_remaining_buckets(const std::vector<size_t>& unused) {
  for (size_t i : unused) {
    copy_in_unused(i);
    mark_ready(i);
  }
  launch_ready_buckets(true);
  TORCH_INTERNAL_ASSERT(next_bucket == buckets.size());
}

// From the allreduce of which parameters each rank used (Note [Unused
// parameters]): per parameter, how many ranks used it.
void Reducer::State::record_global_unused(const torch::Tensor& counts) {
  const auto* count = counts.data_ptr<float>();
  for (size_t i = 0; i < params.size(); ++i) {
    global_unused[i] = count[i] == 0 ? 1 : 0;
  }
  static_used_known = options.static_graph();
}

std::vector<size_t> Reducer::State::record_unused() {
  std::vector<size_t> unused;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!ready[i]) {
      unused.push_back(i);
    }
  }
  const bool first_static = options.static_graph() && !static_recorded && !shadowing;
  if (static_recorded && !shadowing) {
    for (size_t i : unused) {
      surprises[i] = kNoGradientFromUsed;
    }
  }
  if (recording_order()) {
    // Note [Rebuilding buckets]: what got no gradient goes last, or first
    // when static_graph will make it ready at the start of every backward.
    ready_order.insert(first_static ? ready_order.begin() : ready_order.end(), unused.rbegin(), unused.rend());
  }
  if (first_static) {
    static_unused.assign(params.size(), 0);
    for (size_t i : unused) {
      static_unused[i] = 1;
    }
    static_recorded = true;
  }
  return unused;
}

std::vector<torch::Tensor> Reducer::State::wait_buckets(bool copy_each) {
  std::vector<torch::Tensor> reduced;
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    auto averaged = bucket.result->wait();
    bucket.result.reset();
    bucket.allreduce_span.end();
    TORCH_CHECK(averaged.defined(), where(), "the communication hook's result for ", bucket.name,
                " is an undefined tensor; it must be the bucket's ", bucket.buffer.numel(),
                " reduced values, as comm_hooks::allreduce's is.");
    TORCH_CHECK(averaged.numel() == bucket.buffer.numel(), where(), "the communication hook returned ",
                averaged.numel(), " values for ", bucket.name, ", which has ", bucket.buffer.numel(), ".");
    // Copied into floating-point gradients, integers would be taken at face
    // value: a quantising hook that forgot to dequantise, silently 100x off.
    TORCH_CHECK(!at::isIntegralType(averaged.scalar_type(), /*includeBool=*/true), where(),
                "the communication hook returned ", averaged.scalar_type(), " values for ", bucket.name,
                ", whose gradients are ", bucket.buffer.scalar_type(), ": a hook that compresses to integers must "
                "decompress (scale back, and cast to a floating-point type) before it returns.");
    if (copy_each) {
      copy_out(b, averaged);
    }
    reduced.push_back(std::move(averaged));
  }
  return reduced;
}

// The averages into .grad, except for what no rank used (Note [Unused
// parameters]), whose .grad is left as it was.
void Reducer::State::copy_out(size_t b, const torch::Tensor& reduced) {
  auto& bucket = buckets[b];
  timeline::Span span([&] { return "copy-out bucket " + std::to_string(b); }, bucket.bytes);
  if (!reduced.is_same(bucket.buffer)) {
    bucket.buffer.copy_(reduced.view(bucket.buffer.sizes()));
  }
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const size_t index = bucket.params[k];
    auto& grad = params[index].mutable_grad();
    const auto saved = std::move(saved_grads[index]);
    saved_grads[index] = torch::Tensor();
    if (global_unused[index]) {
      if (saved.defined()) {
        bucket.views[k].copy_(saved);
      }
    } else if (options.gradient_as_bucket_view() || slot_may_become_grad(index, bucket.views[k])) {
      grad = bucket.views[k]; // Note [Gradients that are bucket slots]
    } else if (grad.defined()) {
      if (grad.data_ptr() != bucket.views[k].data_ptr()) {
        grad.copy_(bucket.views[k]);
      }
    } else {
      grad = bucket.views[k].clone();
    }
  }
}

// Plain mode: this rank's unused parameters, or the number of other ranks
// that had some, make every rank throw.
void Reducer::State::check_unused(const std::vector<size_t>& unused, int ranks) const {
  if (!unused.empty() && !shadowing) {
    std::string list;
    for (size_t k = 0; k < unused.size() && k < 10; ++k) {
      list += (k ? ", '" : "'") + names[unused[k]] + "'";
    }
    if (unused.size() > 10) {
      list += " and " + std::to_string(unused.size() - 10) + " more";
    }
    TORCH_CHECK(false, where(), unused.size(), " parameter(s) received no gradient in this backward: ", list,
                ". Their buckets were reduced anyway so that no rank hangs. If the model skips parameters on "
                "purpose, pass DistributedOptions().find_unused_parameters(true) (or static_graph(true) when it "
                "always skips the same ones); otherwise make forward use them, or set requires_grad(false) on them "
                "before wrapping.");
  }
  TORCH_CHECK(ranks == 0, where(), ranks, " other rank(s) had parameters that received no gradient "
              "in this backward (their errors name them). If the model skips parameters on purpose, pass "
              "DistributedOptions().find_unused_parameters(true).");
}

void Reducer::State::throw_static_graph_error() {
  auto mine = torch::tensor(surprises, torch::kLong).to(params[0].device());
  const auto all = group.all_gather(mine);
  std::string list;
  size_t count = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    const auto codes = all[r].cpu();
    for (int64_t i = 0; i < codes.numel(); ++i) {
      const auto code = codes[i].item<int64_t>();
      if (code == kNone) {
        continue;
      }
      if (count++ < 10) {
        list += std::string(count > 1 ? "; " : "") + "rank " + std::to_string(r) + "'s '" + names[i] + "' " +
            (code == kGradientFromUnused ? "received a gradient, but got none in the first iteration"
                                         : "received no gradient, but got one in the first iteration");
      }
    }
  }
  if (count > 10) {
    list += "; and " + std::to_string(count - 10) + " more";
  }
  TORCH_CHECK(false, where(), "DistributedOptions().static_graph(true) promises that the same parameters get "
              "gradients in every iteration, but in this one ", list, ". This iteration's gradients were not averaged "
              "into .grad. If the set of parameters used changes between iterations, use "
              "DistributedOptions().find_unused_parameters(true) without static_graph.");
}

} // namespace detail
} // namespace lockstep
