#include <lockstep/detail/reducer.h>

#include <lockstep/distributed_data_parallel.h>

#include "torch_compat.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <cstdio>
#include <map>

namespace lockstep {
namespace detail {

std::vector<std::vector<size_t>> compute_bucket_assignment(
    const std::vector<int64_t>& bytes,
    const std::vector<std::string>& keys,
    int64_t first_cap,
    int64_t cap) {
  TORCH_CHECK(bytes.size() == keys.size(), "compute_bucket_assignment: ", bytes.size(), " sizes but ", keys.size(), " keys.");
  TORCH_CHECK(first_cap > 0 && cap > 0, "lockstep: bucket caps must be > 0 bytes, but got ", first_cap, " and ", cap, ".");
  struct Open {
    std::vector<size_t> params;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::string, Open> open;
  std::vector<std::string> key_order; // keys in the order first seen, for the leftovers
  std::vector<std::vector<size_t>> buckets;
  for (size_t k = bytes.size(); k-- > 0;) {
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
// unless find_unused_parameters is set, one more tiny allreduce tells every
// rank whether any rank had parameters without gradients, so that they all
// raise the error instead of one raising and the others hanging.

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

  struct Bucket {
    std::vector<size_t> params;
    torch::Tensor buffer;
    std::vector<torch::Tensor> views; // per param of the bucket, shaped as the param
    size_t pending = 0;
    std::shared_ptr<PendingReduction> result;
    std::string name;
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
  std::vector<detail::NodePtr> accumulators;
  std::vector<uintptr_t> hook_keys;

  std::string where() const {
    return "lockstep::DistributedDataParallel: rank " + std::to_string(group.rank()) + ": ";
  }

  void autograd_hook(size_t index);
  void mark_ready(size_t index);
  void launch_ready_buckets();
  void finalize_backward();
};

namespace {

std::string mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1024 * 1024));
  return text;
}

} // namespace

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

  std::vector<int64_t> bytes;
  std::vector<std::string> keys;
  for (const auto& p : s.params) {
    bytes.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
    keys.push_back(std::string(c10::toString(p.scalar_type())) + "@" + p.device().str());
  }
  auto assignment = compute_bucket_assignment(
      bytes, keys, std::min(s.options.first_bucket_bytes(), s.options.bucket_bytes()), s.options.bucket_bytes());
  s.slot_of.resize(s.params.size());
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < assignment.size(); ++b) {
    State::Bucket bucket;
    bucket.params = std::move(assignment[b]);
    int64_t numel = 0;
    for (size_t i : bucket.params) {
      numel += s.params[i].numel();
    }
    const auto& first = s.params[bucket.params.front()];
    bucket.buffer = torch::zeros({numel}, first.options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& p = s.params[bucket.params[k]];
      // set_() on the bucket's storage rather than narrow().view(): the slot
      // aliases the bucket without being an autograd view, so that .grad can
      // be the slot and still take the C++ optimizer's zero_grad(), which
      // calls detach_() (refused on views).
      bucket.views.push_back(torch::empty({0}, bucket.buffer.options())
                                 .set_(bucket.buffer.storage(), offset, p.sizes(), c10::contiguous_strides(p.sizes())));
      s.slot_of[bucket.params[k]] = {b, k};
      offset += p.numel();
    }
    bucket.name = "bucket " + std::to_string(b) + " (" + std::to_string(bucket.params.size()) + " parameters, " +
        mib(numel * static_cast<int64_t>(first.element_size())) + ")";
    s.buckets.push_back(std::move(bucket));
  }
  if (s.options.gradient_as_bucket_view()) {
    // .grad is the bucket slot from the start: backward accumulates into the
    // bucket, and no copy or gradient-sized memory is needed besides it.
    for (size_t i = 0; i < s.params.size(); ++i) {
      auto& view = s.buckets[s.slot_of[i].first].views[s.slot_of[i].second];
      auto& grad = s.params[i].mutable_grad();
      if (grad.defined()) {
        view.copy_(grad);
      }
      grad = view;
    }
  }
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

void Reducer::prepare_for_backward(bool sync) {
  State& s = *state_;
  s.phase = sync ? State::Phase::Expecting : State::Phase::Unsynced;
  s.ready.assign(s.params.size(), 0);
  s.next_bucket = 0;
  for (auto& b : s.buckets) {
    b.pending = b.params.size();
    b.result.reset();
  }
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
  TORCH_CHECK(
      !ready[index], where(), "parameter '", names[index],
      "' received its gradient twice after one forward (a second backward through the same graph?). Run forward "
      "again before each backward.");
  if (!finalize_queued) {
    finalize_queued = true;
    std::weak_ptr<State> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) {
        state->finalize_backward();
      }
    });
  }
  auto& view = buckets[slot_of[index].first].views[slot_of[index].second];
  auto& grad = params[index].mutable_grad();
  torch::NoGradGuard no_grad;
  // The built-in allreduce sums what the ranks put in: put in grad / world,
  // in the same pass as the copy.
  const bool built_in = !options.comm_hook();
  if (!grad.defined()) {
    view.zero_();
  } else if (options.gradient_as_bucket_view() && grad.data_ptr() == view.data_ptr()) {
    if (built_in) {
      view.div_(group.size());
    }
  } else {
    if (built_in) {
      at::mul_out(view, grad, at::scalar_tensor(1.0 / group.size(), grad.options()));
    } else {
      view.copy_(grad);
    }
    if (options.gradient_as_bucket_view()) {
      grad = view; // zero_grad(set_to_none) or a stolen gradient replaced the view
    }
  }
  mark_ready(index);
}

void Reducer::State::mark_ready(size_t index) {
  ready[index] = 1;
  auto& bucket = buckets[slot_of[index].first];
  TORCH_INTERNAL_ASSERT(bucket.pending > 0);
  if (--bucket.pending == 0) {
    launch_ready_buckets();
  }
}

void Reducer::State::launch_ready_buckets() {
  while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
    auto& bucket = buckets[next_bucket];
    if (options.comm_hook()) {
      GradBucket view{next_bucket, bucket.buffer, bucket.params, bucket.name};
      bucket.result = options.comm_hook()(group, view);
    } else {
      // The gradients were divided by the world size on their way in.
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

  std::vector<size_t> unused;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!ready[i]) {
      unused.push_back(i);
    }
  }
  // Zeros for what got no gradient, so that every bucket is reduced on every
  // rank in the same order: nobody waits for a collective that never comes.
  for (size_t i : unused) {
    buckets[slot_of[i].first].views[slot_of[i].second].zero_();
    mark_ready(i);
  }
  TORCH_INTERNAL_ASSERT(next_bucket == buckets.size());

  torch::Tensor unused_ranks;
  std::shared_ptr<Work> check;
  if (!options.find_unused_parameters()) {
    unused_ranks = torch::full({1}, unused.empty() ? 0.0f : 1.0f, torch::TensorOptions().device(params[0].device()));
    check = group.allreduce_async({unused_ranks}, ReduceOp::Sum, "the check for parameters without gradients");
  }

  for (auto& bucket : buckets) {
    auto averaged = bucket.result->wait();
    bucket.result.reset();
    if (!averaged.is_same(bucket.buffer)) {
      TORCH_CHECK(averaged.numel() == bucket.buffer.numel(), where(), "the communication hook returned ",
                  averaged.numel(), " values for ", bucket.name, ", which has ", bucket.buffer.numel(), ".");
      bucket.buffer.copy_(averaged.view(bucket.buffer.sizes()));
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
  }

  if (check) {
    check->wait();
    const auto ranks = unused_ranks.item<float>();
    if (!unused.empty()) {
      std::string list;
      for (size_t k = 0; k < unused.size() && k < 10; ++k) {
        list += (k ? ", '" : "'") + names[unused[k]] + "'";
      }
      if (unused.size() > 10) {
        list += " and " + std::to_string(unused.size() - 10) + " more";
      }
      TORCH_CHECK(false, where(), unused.size(), " parameter(s) received no gradient in this backward: ", list,
                  ". Their buckets were reduced as zeros so that no rank hangs. If the model skips parameters on "
                  "purpose, pass DistributedOptions().find_unused_parameters(true); otherwise make forward use them, "
                  "or set requires_grad(false) on them before wrapping.");
    }
    TORCH_CHECK(ranks == 0, where(), static_cast<int>(ranks), " other rank(s) had parameters that received no gradient "
                "in this backward (their errors name them). If the model skips parameters on purpose, pass "
                "DistributedOptions().find_unused_parameters(true).");
  }
}

} // namespace detail
} // namespace lockstep
