#include <lockstep/detail/reducer.h>

#include <lockstep/distributed_data_parallel.h>
#include <lockstep/timeline.h>

#include "torch_compat.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <cstdio>
#include <map>

namespace lockstep {
namespace detail {

std::vector<std::vector<size_t>> compute_bucket_assignment(
    const std::vector<int64_t>& bytes,
    const std::vector<std::string>& keys,
    int64_t first_cap,
    int64_t cap,
    const std::vector<size_t>& order) {
  TORCH_CHECK(bytes.size() == keys.size(), "compute_bucket_assignment: ", bytes.size(), " sizes but ", keys.size(), " keys.");
  TORCH_CHECK(first_cap > 0 && cap > 0, "lockstep: bucket caps must be > 0 bytes, but got ", first_cap, " and ", cap, ".");
  std::vector<size_t> sequence = order;
  if (sequence.empty()) {
    for (size_t k = bytes.size(); k-- > 0;) {
      sequence.push_back(k);
    }
  }
  TORCH_CHECK(sequence.size() == bytes.size(), "compute_bucket_assignment: an order of ", sequence.size(),
              " indices for ", bytes.size(), " parameters.");
  struct Open {
    std::vector<size_t> params;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::string, Open> open;
  std::vector<std::string> key_order; // keys in the order first seen, for the leftovers
  std::vector<char> seen(bytes.size(), 0);
  std::vector<std::vector<size_t>> buckets;
  for (size_t k : sequence) {
    TORCH_CHECK(k < bytes.size() && !seen[k], "compute_bucket_assignment: the order is not a permutation of the ",
                bytes.size(), " parameter indices (", k, ").");
    seen[k] = 1;
    auto [it, inserted] = open.try_emplace(keys[k]);
    if (inserted) {
      key_order.push_back(keys[k]);
    }
    Open& bucket = it->second;
    bucket.params.push_back(k);
    bucket.bytes += bytes[k];
    if (bucket.bytes >= (bucket.first ? first_cap : cap)) {
      buckets.push_back(std::move(bucket.params));
      bucket.params.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (const auto& key : key_order) {
    if (!open[key].params.empty()) {
      buckets.push_back(std::move(open[key].params));
    }
  }
  return buckets;
}

// Note [Reducer state]
// ~~~~~~~~~~~~~~~~~~~~
// A forward through DistributedDataParallel calls prepare_for_backward, which
// puts the reducer in phase Expecting (or Unsynced under no_sync). Each
// parameter's gradient accumulator has a post hook; in Expecting, it copies
// the accumulated .grad into the parameter's slot of its bucket (or, with
// gradient_as_bucket_view, makes .grad that slot) and marks the parameter
// ready. Buckets are launched strictly in order, so every rank issues the same
// collectives in the same order whatever order its gradients arrive in. The
// first hook queues finalize_backward on the engine, which runs when backward
// ends: parameters that got no gradient are reduced as zeros (so no rank
// waits forever), every bucket is waited for and copied back into .grad, and,
// in plain mode (neither find_unused_parameters nor static_graph), one more
// tiny allreduce tells every rank whether any rank had parameters without
// gradients, so that they all raise the error instead of one raising and the
// others hanging.
//
// Note [Rebuilding buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The first buckets follow reverse registration order, a guess at the order
// backward produces gradients. The first reducing backward records the order
// the hooks actually fired in (parameters without a gradient last, or first
// under static_graph, where they are ready as soon as backward starts). At
// the next reducing forward, one rank's record is broadcast (rank 0's, or
// under join the first rank still training) and every rank rebuilds the same
// buckets from it, once. Gradients already accumulated (no_sync, or views)
// move into the new buckets.
//
// Note [Static graph]
// ~~~~~~~~~~~~~~~~~~~
// static_graph(true) promises that every iteration gives gradients to the
// same parameters. The first reducing backward records which ones got none;
// later ones mark those ready (as zeros) when backward starts, so their
// buckets go out at once, and skip both the search at the end of backward
// and plain mode's check collective. A broken promise must still fail on
// every rank, with no collective added to the normal step. So the last
// bucket carries one trailing element, a flag: a rank that saw a recorded
// parameter without gradient, or an unrecorded one with one, sets it. The
// last bucket is launched only once backward has ended, when both kinds of
// surprise are known; it is waited for with the others, and a non-zero flag
// (any reduction keeps it non-zero: a sum, an average, a cast to 16 bits)
// makes every rank exchange what it saw, in one all_gather, and throw the
// same error naming the rank and the parameter.

struct Reducer::State : std::enable_shared_from_this<Reducer::State> {
  // Runs autograd_hook once the parameter's gradient is accumulated.
  class ReadyHook : public torch::autograd::FunctionPostHook {
   public:
    ReadyHook(std::weak_ptr<State> state, size_t index) : state_(std::move(state)), index_(index) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& outputs,
        const torch::autograd::variable_list& /*inputs*/) override {
      if (auto state = state_.lock()) {
        state->autograd_hook(index_);
      }
      return outputs;
    }

   private:
    std::weak_ptr<State> state_;
    size_t index_;
  };

  enum class Phase { Idle, Expecting, Unsynced };
  // What a rank saw under static_graph that the first iteration did not.
  enum Surprise : int64_t { kNone = 0, kGradientFromUnused = 1, kNoGradientFromUsed = 2 };

  struct Bucket {
    std::vector<size_t> params;
    torch::Tensor buffer; // the gradients, then the static_graph flag in the last bucket
    std::vector<torch::Tensor> views; // per param of the bucket, shaped as the param
    size_t pending = 0;
    std::shared_ptr<PendingReduction> result;
    std::string name;
    int64_t bytes = 0;
    int64_t launched_us = 0; // Note [Timeline] in src/timeline.cpp
  };

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  ProcessGroup group;
  DistributedOptions options;
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> slot_of; // param -> (bucket, position)
  std::vector<char> ready;
  size_t next_bucket = 0;
  Phase phase = Phase::Idle;
  bool finalize_queued = false;
  bool shadowing = false; // shadow_backward: zeros, nothing recorded
  int64_t divisor = 1;
  // Note [Rebuilding buckets]
  bool rebuilt = false;
  std::vector<size_t> ready_order;
  // Note [Static graph]
  bool static_recorded = false;
  std::vector<char> static_unused;
  std::vector<int64_t> surprises;
  std::vector<detail::NodePtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  int64_t backward_start_us = 0;

  std::string where() const {
    return "lockstep::DistributedDataParallel: rank " + std::to_string(group.rank()) + ": ";
  }
  bool checks_unused() const {
    return !options.find_unused_parameters() && !options.static_graph();
  }
  bool recording_order() const {
    return options.rebuild_buckets() && !rebuilt && !shadowing;
  }

  void build_buckets(const std::vector<size_t>& order);
  void autograd_hook(size_t index);
  void mark_ready(size_t index);
  void launch_ready_buckets(bool backward_ended);
  void finalize_backward();
  void throw_static_graph_error();
};

namespace {

std::string mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1024 * 1024));
  return text;
}

} // namespace

void Reducer::State::build_buckets(const std::vector<size_t>& order) {
  std::vector<int64_t> bytes;
  std::vector<std::string> keys;
  for (const auto& p : params) {
    bytes.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
    keys.push_back(std::string(c10::toString(p.scalar_type())) + "@" + p.device().str());
  }
  auto assignment = compute_bucket_assignment(
      bytes, keys, std::min(options.first_bucket_bytes(), options.bucket_bytes()), options.bucket_bytes(), order);
  std::vector<Bucket> built;
  slot_of.assign(params.size(), {0, 0});
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    bucket.params = std::move(assignment[b]);
    int64_t numel = 0;
    for (size_t i : bucket.params) {
      numel += params[i].numel();
    }
    const bool flag = options.static_graph() && b + 1 == assignment.size();
    const auto& first = params[bucket.params.front()];
    bucket.buffer = torch::zeros({numel + (flag ? 1 : 0)}, first.options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& p = params[bucket.params[k]];
      // set_() on the bucket's storage rather than narrow().view(): the slot
      // aliases the bucket without being an autograd view, so that .grad can
      // be the slot and still take the C++ optimizer's zero_grad(), which
      // calls detach_() (refused on views).
      bucket.views.push_back(torch::empty({0}, bucket.buffer.options())
                                 .set_(bucket.buffer.storage(), offset, p.sizes(), c10::contiguous_strides(p.sizes())));
      slot_of[bucket.params[k]] = {b, k};
      offset += p.numel();
    }
    bucket.bytes = numel * static_cast<int64_t>(first.element_size());
    bucket.name = "bucket " + std::to_string(b) + " (" + std::to_string(bucket.params.size()) + " parameters, " +
        mib(bucket.bytes) + ")";
    built.push_back(std::move(bucket));
  }
  buckets = std::move(built);
  if (options.gradient_as_bucket_view()) {
    // .grad is the bucket slot: backward accumulates into the bucket, and no
    // copy or gradient-sized memory is needed besides it. A gradient already
    // there (an earlier bucket's slot, or one the caller set) moves in.
    for (size_t i = 0; i < params.size(); ++i) {
      auto& view = buckets[slot_of[i].first].views[slot_of[i].second];
      auto& grad = params[i].mutable_grad();
      if (grad.defined()) {
        view.copy_(grad);
      }
      grad = view;
    }
  }
}

Reducer::Reducer(
    std::vector<torch::Tensor> params,
    std::vector<std::string> names,
    ProcessGroup group,
    const DistributedOptions& options)
    : state_(std::make_shared<State>()) {
  TORCH_INTERNAL_ASSERT(params.size() == names.size());
  State& s = *state_;
  s.params = std::move(params);
  s.names = std::move(names);
  s.group = std::move(group);
  s.options = options;
  s.divisor = s.group.size();
  s.build_buckets({});
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);
    TORCH_INTERNAL_ASSERT(accumulator, "parameter without a gradient accumulator");
    s.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<State::ReadyHook>(state_, i)));
    s.accumulators.push_back(std::move(accumulator)); // the hook lives only as long as the node
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < state_->accumulators.size(); ++i) {
    state_->accumulators[i]->del_post_hook(state_->hook_keys[i]);
  }
}

std::vector<std::vector<size_t>> Reducer::buckets() const {
  std::vector<std::vector<size_t>> result;
  for (const auto& b : state_->buckets) {
    result.push_back(b.params);
  }
  return result;
}

torch::Device Reducer::device() const {
  return state_->params[0].device();
}

bool Reducer::rebuild_pending() const {
  return state_->options.rebuild_buckets() && !state_->rebuilt && state_->ready_order.size() == state_->params.size();
}

void Reducer::rebuild_buckets(int root) {
  State& s = *state_;
  TORCH_INTERNAL_ASSERT(!s.finalize_queued, "buckets rebuilt during backward");
  auto order = torch::empty({static_cast<int64_t>(s.params.size())}, torch::TensorOptions().dtype(torch::kLong));
  if (s.group.rank() == root) {
    TORCH_INTERNAL_ASSERT(s.ready_order.size() == s.params.size(), "the rebuild's root recorded no order");
    for (size_t k = 0; k < s.ready_order.size(); ++k) {
      order[k] = static_cast<int64_t>(s.ready_order[k]);
    }
  }
  auto on_device = order.to(s.params[0].device());
  s.group.broadcast_async({on_device}, root, "the broadcast of rank " + std::to_string(root) + "'s gradient order, to rebuild the buckets")
      ->wait();
  order = on_device.cpu();
  std::vector<size_t> sequence;
  for (int64_t k = 0; k < order.numel(); ++k) {
    sequence.push_back(static_cast<size_t>(order[k].item<int64_t>()));
  }
  s.build_buckets(sequence);
  s.rebuilt = true;
  s.ready_order.clear();
}

void Reducer::set_divisor(int64_t divisor) {
  TORCH_INTERNAL_ASSERT(divisor > 0);
  state_->divisor = divisor;
}

void Reducer::prepare_for_backward(bool sync) {
  State& s = *state_;
  s.phase = sync ? State::Phase::Expecting : State::Phase::Unsynced;
  s.ready.assign(s.params.size(), 0);
  s.surprises.assign(s.params.size(), State::kNone);
  s.next_bucket = 0;
  if (sync && s.recording_order()) {
    s.ready_order.clear();
  }
  for (auto& b : s.buckets) {
    b.pending = b.params.size();
    b.result.reset();
  }
  if (sync && s.static_recorded) {
    // Note [Static graph]: what the first iteration left without a gradient
    // is ready now, as zeros.
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (s.static_unused[i]) {
        s.buckets[s.slot_of[i].first].views[s.slot_of[i].second].zero_();
        s.mark_ready(i);
      }
    }
  }
}

void Reducer::shadow_backward() {
  State& s = *state_;
  s.shadowing = true;
  prepare_for_backward(true);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (!s.ready[i]) {
      s.buckets[s.slot_of[i].first].views[s.slot_of[i].second].zero_();
      s.mark_ready(i);
    }
  }
  try {
    s.finalize_backward();
  } catch (...) {
    s.shadowing = false;
    throw;
  }
  s.shadowing = false;
}

void Reducer::State::autograd_hook(size_t index) {
  if (phase == Phase::Unsynced) {
    return; // no_sync: .grad accumulates locally
  }
  TORCH_CHECK(
      phase == Phase::Expecting, where(), "parameter '", names[index],
      "' received a gradient, but no forward ran through DistributedDataParallel since the last reduction. "
      "Run forward through the DistributedDataParallel before each backward (one backward per forward), and "
      "use no_sync() to accumulate gradients over several passes.");
  if (!finalize_queued) {
    finalize_queued = true;
    backward_start_us = timeline::enabled() ? timeline::detail::now_us() : 0;
    std::weak_ptr<State> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) {
        state->finalize_backward();
      }
    });
  }
  if (static_recorded && static_unused[index]) {
    // Note [Static graph]: its bucket may be gone already; every rank learns
    // of it through the flag.
    surprises[index] = kGradientFromUnused;
    return;
  }
  TORCH_CHECK(
      !ready[index], where(), "parameter '", names[index],
      "' received its gradient twice after one forward (a second backward through the same graph?). Run forward "
      "again before each backward.");
  if (recording_order()) {
    ready_order.push_back(index);
  }
  auto& view = buckets[slot_of[index].first].views[slot_of[index].second];
  auto& grad = params[index].mutable_grad();
  torch::NoGradGuard no_grad;
  const int64_t copy_start = timeline::enabled() ? timeline::detail::now_us() : 0;
  // The built-in allreduce sums what the ranks put in: put in grad / divisor,
  // in the same pass as the copy.
  const bool built_in = !options.comm_hook();
  if (!grad.defined()) {
    view.zero_();
  } else if (options.gradient_as_bucket_view() && grad.data_ptr() == view.data_ptr()) {
    if (built_in) {
      view.div_(divisor);
    }
  } else {
    if (built_in) {
      at::mul_out(view, grad, at::scalar_tensor(1.0 / static_cast<double>(divisor), grad.options()));
    } else {
      view.copy_(grad);
    }
    if (options.gradient_as_bucket_view()) {
      grad = view; // zero_grad(set_to_none) or a stolen gradient replaced the view
    }
  }
  if (timeline::enabled()) {
    timeline::detail::record("copy-in bucket " + std::to_string(slot_of[index].first), copy_start,
                             timeline::detail::now_us(), "", view.numel() * static_cast<int64_t>(view.element_size()));
  }
  mark_ready(index);
}

void Reducer::State::mark_ready(size_t index) {
  ready[index] = 1;
  auto& bucket = buckets[slot_of[index].first];
  TORCH_INTERNAL_ASSERT(bucket.pending > 0);
  if (--bucket.pending == 0) {
    launch_ready_buckets(false);
  }
}

void Reducer::State::launch_ready_buckets(bool backward_ended) {
  while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
    const bool flagged = options.static_graph() && next_bucket + 1 == buckets.size();
    if (flagged && !backward_ended) {
      return; // Note [Static graph]: the flag is known only once backward has ended
    }
    auto& bucket = buckets[next_bucket];
    if (flagged) {
      const bool surprised = std::any_of(surprises.begin(), surprises.end(), [](int64_t s) { return s != kNone; });
      bucket.buffer[-1].fill_(surprised ? 1 : 0);
    }
    bucket.launched_us = timeline::enabled() ? timeline::detail::now_us() : 0;
    if (options.comm_hook()) {
      GradBucket view{next_bucket, bucket.buffer, bucket.params, bucket.name};
      bucket.result = options.comm_hook()(group, view);
    } else {
      // The gradients were divided by the divisor on their way in.
      bucket.result = comm_hooks::pending(
          group.allreduce_async({bucket.buffer}, ReduceOp::Sum, "allreduce of " + bucket.name), bucket.buffer);
    }
    TORCH_CHECK(bucket.result != nullptr, where(), "the communication hook returned no result for ", bucket.name, ".");
    ++next_bucket;
  }
}

void Reducer::State::finalize_backward() {
  finalize_queued = false;
  phase = Phase::Idle;
  torch::NoGradGuard no_grad;
  struct BackwardSpan { // Note [Timeline]: from the first hook to the end of this callback
    int64_t start;
    bool shadow;
    ~BackwardSpan() {
      if (timeline::enabled() && !shadow) {
        timeline::detail::record("backward", start, timeline::detail::now_us());
      }
    }
  } backward_span{backward_start_us, shadowing};

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
  // Zeros for what got no gradient, so that every bucket is reduced on every
  // rank in the same order: nobody waits for a collective that never comes.
  for (size_t i : unused) {
    buckets[slot_of[i].first].views[slot_of[i].second].zero_();
    mark_ready(i);
  }
  launch_ready_buckets(true);
  TORCH_INTERNAL_ASSERT(next_bucket == buckets.size());

  torch::Tensor unused_ranks;
  std::shared_ptr<Work> check;
  if (checks_unused()) {
    const bool mine = !unused.empty() && !shadowing;
    unused_ranks = torch::full({1}, mine ? 1.0f : 0.0f, torch::TensorOptions().device(params[0].device()));
    check = group.allreduce_async({unused_ranks}, ReduceOp::Sum, "the check for parameters without gradients");
  }

  std::vector<torch::Tensor> reduced;
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    auto averaged = bucket.result->wait();
    bucket.result.reset();
    if (timeline::enabled()) {
      timeline::detail::record("allreduce bucket " + std::to_string(b), bucket.launched_us, timeline::detail::now_us(),
                               "collectives", bucket.bytes);
    }
    TORCH_CHECK(averaged.numel() == bucket.buffer.numel(), where(), "the communication hook returned ",
                averaged.numel(), " values for ", bucket.name, ", which has ", bucket.buffer.numel(), ".");
    reduced.push_back(std::move(averaged));
  }
  if (options.static_graph() && reduced.back()[-1].item<double>() != 0) {
    throw_static_graph_error();
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = buckets[b];
    const int64_t copy_start = timeline::enabled() ? timeline::detail::now_us() : 0;
    if (!reduced[b].is_same(bucket.buffer)) {
      bucket.buffer.copy_(reduced[b].view(bucket.buffer.sizes()));
    }
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      auto& grad = params[bucket.params[k]].mutable_grad();
      if (options.gradient_as_bucket_view()) {
        grad = bucket.views[k];
      } else if (grad.defined()) {
        grad.copy_(bucket.views[k]);
      } else {
        grad = bucket.views[k].clone();
      }
    }
    if (timeline::enabled()) {
      timeline::detail::record("copy-out bucket " + std::to_string(b), copy_start, timeline::detail::now_us(), "",
                               bucket.bytes);
    }
  }

  if (check) {
    check->wait();
    const auto ranks = unused_ranks.item<float>();
    if (!unused.empty() && !shadowing) {
      std::string list;
      for (size_t k = 0; k < unused.size() && k < 10; ++k) {
        list += (k ? ", '" : "'") + names[unused[k]] + "'";
      }
      if (unused.size() > 10) {
        list += " and " + std::to_string(unused.size() - 10) + " more";
      }
      TORCH_CHECK(false, where(), unused.size(), " parameter(s) received no gradient in this backward: ", list,
                  ". Their buckets were reduced as zeros so that no rank hangs. If the model skips parameters on "
                  "purpose, pass DistributedOptions().find_unused_parameters(true) (or static_graph(true) when it "
                  "always skips the same ones); otherwise make forward use them, or set requires_grad(false) on them "
                  "before wrapping.");
    }
    TORCH_CHECK(ranks == 0, where(), static_cast<int>(ranks), " other rank(s) had parameters that received no gradient "
                "in this backward (their errors name them). If the model skips parameters on purpose, pass "
                "DistributedOptions().find_unused_parameters(true).");
  }
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
