#include "ddp/reducer.h"

#include <lockstep/distributed_options.h>
#include <lockstep/timeline.h>

#include "comm/collective_fingerprint.h"
#include "comm/planned_collective.h"
#include "ddp/reducer_state.h"
#include "util/bucket_key.h"
#include "util/row_layout.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

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
namespace {

// Where to look when the ranks' bucket plans differ (agree_on_plan).
constexpr const char* kBucketPlanHint =
    "Each rank makes them from the model, the order its parameters' gradients became ready in, and "
    "DistributedOptions (bucket_cap_mb): look for one of these that differs between ranks.";

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
    keys.push_back(bucket_key(p.scalar_type(), p.device()));
  }
  auto assignment = compute_bucket_assignment(
      bytes, keys, std::min(options.first_bucket_bytes(), options.bucket_bytes()), options.bucket_bytes(), order);
  std::vector<Bucket> built;
  std::vector<PlanItem> plan_items;
  // Note [Planned collectives]: a hook may reduce less than the buffer, so
  // its buckets carry no words.
  const int64_t words = options.comm_hook() ? 0 : plan_words_elements(group.size());
  slot_of.assign(params.size(), {0, 0});
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    bucket.params = std::move(assignment[b]);
    int64_t numel = 0;
    for (size_t i : bucket.params) {
      numel += params[i].numel();
    }
    const bool flag = flag_in_last_bucket() && b + 1 == assignment.size();
    const auto& first = params[bucket.params.front()];
    bucket.numel = numel;
    bucket.bytes = numel * static_cast<int64_t>(first.element_size());
    bucket.name = "bucket " + std::to_string(b) + " (" + std::to_string(bucket.params.size()) + " parameters, " +
        mib(bucket.bytes) + ")";
    plan_items.push_back({numel + (flag ? 1 : 0) + words, first.scalar_type()});
    built.push_back(std::move(bucket));
  }
  plan = agree_on_plan(group, "DistributedDataParallel's buckets", plan_items, params[0].device(), kBucketPlanHint);
  auto memory = bucket_memory(plan_items);
  for (size_t b = 0; b < built.size(); ++b) {
    auto& bucket = built[b];
    const auto options = params[bucket.params.front()].options().requires_grad(false);
    // On shared memory, set_() rather than view(dtype): the buffer holds no
    // base tensor, only the storage (Note [Gradients that are bucket slots]).
    bucket.buffer = memory.empty() ? torch::zeros({plan_items[b].elements}, options)
                                   : torch::empty({0}, options).set_(memory[b].storage(), 0, {plan_items[b].elements}, {1});
    bucket.shared = !memory.empty();
    int64_t offset = 0;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& p = params[bucket.params[k]];
      // set_() on the bucket's storage rather than narrow().view(): the slot
      // aliases the bucket without being an autograd view, so that .grad can
      // be the slot and still take the C++ optimizer's zero_grad(), which
      // calls detach_() (refused on views). Its strides: slot_strides.
      bucket.views.push_back(
          torch::empty({0}, options).set_(bucket.buffer.storage(), offset, p.sizes(), slot_strides(p)));
      slot_of[bucket.params[k]] = {b, k};
      offset += p.numel();
    }
  }
  const auto moving = gradients_to_move();
  buckets = std::move(built);
  move_gradients_into_slots(moving);
}

// Note [Buffers every rank can reach]: the built-in allreduce of a CPU
// bucket then reads the other ranks' buckets where they lie. A comm hook
// chooses what it reduces, mostly a compressed copy (fp16, PowerSGD), where
// such buckets would only take room in /dev/shm: it gets ordinary memory.
std::vector<torch::Tensor> Reducer::State::bucket_memory(const std::vector<PlanItem>& items) const {
  const bool on_cpu = std::all_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.is_cpu(); });
  if (options.comm_hook() || !on_cpu) {
    return {};
  }
  std::vector<int64_t> bytes;
  for (const auto& item : items) {
    bytes.push_back(item.elements * static_cast<int64_t>(c10::elementSize(item.dtype)));
  }
  return group.shared_buffers(bytes);
}

// .grad is the bucket slot: backward accumulates into the bucket, and no
// copy or gradient-sized memory is needed besides it. Under
// gradient_as_bucket_view a gradient already there (an earlier bucket's
// slot, or one the caller set) moves in; otherwise, one that was a slot
// (gradients_to_move). An undefined .grad stays undefined until a backward
// reaches it, as in c10d's Reducer::initialize_bucket_views: a zero .grad
// from construction would let an optimizer step apply weight decay before
// any backward.
void Reducer::State::move_gradients_into_slots(const std::vector<char>& which) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& grad = params[i].mutable_grad();
    if (which[i] && grad.defined()) {
      auto& view = buckets[slot_of[i].first].views[slot_of[i].second];
      view.copy_(grad);
      grad = view;
    }
  }
}

Reducer::Reducer(
    std::vector<torch::Tensor> params,
    std::vector<std::string> names,
    ProcessGroup group,
    const DistributedOptions& options,
    int64_t model)
    : state_(std::make_shared<State>()) {
  TORCH_INTERNAL_ASSERT(params.size() == names.size());
  State& s = *state_;
  s.params = std::move(params);
  s.names = std::move(names);
  s.group = std::move(group);
  s.options = options;
  s.model = model;
  s.divisor = s.group.size();
  s.used_since_sync.assign(s.params.size(), 0);
  s.global_unused.assign(s.params.size(), 0);
  s.saved_grads.resize(s.params.size());
  s.build_buckets({});
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);
    TORCH_INTERNAL_ASSERT(accumulator, "parameter without a gradient accumulator");
    s.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<State::ReadyHook>(state_, i)));
    s.accumulators.push_back(std::move(accumulator)); // the hook lives only as long as the node
  }
}

void Reducer::check_not_reduced(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names, int rank) {
  for (size_t i = 0; i < params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    TORCH_INTERNAL_ASSERT(accumulator, "parameter without a gradient accumulator");
    for (const auto& hook : accumulator->post_hooks()) {
      TORCH_CHECK(dynamic_cast<const State::ReadyHook*>(hook.get()) == nullptr,
                  "lockstep::DistributedDataParallel: rank ", rank, ": parameter '", names[i],
                  "' is already reduced by another DistributedDataParallel that is still alive (the same module "
                  "wrapped twice, or two modules sharing it). Its gradient would be averaged twice. Wrap a module "
                  "once and keep using that wrapper, or destroy the first wrapper before making another.");
    }
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

void Reducer::check_last_backward_finished() const {
  // The callback that ends a backward is queued by its first hook; an
  // exception inside backward drops it, and with it the end of the step.
  TORCH_CHECK(!state_->finalize_queued, state_->where(), "the last backward stopped with an error before its end, "
              "so its gradients were never averaged, and some of its collectives may have reached the other ranks "
              "and some not. This DistributedDataParallel cannot go on from there: let the error end the job (the "
              "launcher restarts it from the last checkpoint), or make a new DistributedDataParallel on every rank.");
}

// Note [A parameter replaced after wrapping]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A to() of another dtype or device, a set_data, and LibTorch's torch::load
// (which set_()s each parameter) give a parameter a new gradient
// accumulator: the hook this reducer put on the old one never fires again,
// and the gradient would stay local to each rank. Moving the hook to the new
// accumulator would make a torch::load on some ranks only (rank 0's, as
// with Python's habit of loading there) train ranks with other weights
// without a word, since nothing compares parameters after wrapping. So each
// forward refuses it, on the rank that replaced them; the others fail at
// the collective it never joins. Loading before wrapping (the wrapper then
// copies rank 0's parameters to every rank) or load_safetensors (a copy_
// into the same tensors) keep the hooks.
void Reducer::check_hooks_attached() const {
  const State& s = *state_;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const auto& param = s.params[i];
    if (torch::autograd::impl::try_get_grad_accumulator(param).get() == s.accumulators[i].get()) {
      continue;
    }
    const auto& slot = s.buckets[s.slot_of[i].first].views[s.slot_of[i].second];
    TORCH_CHECK(false, s.where(), "parameter '", s.names[i], "' is no longer the tensor it was when the module was "
                "wrapped (", slot.sizes(), " ", slot.scalar_type(), " on ", slot.device(), " then, ", param.sizes(), " ",
                param.scalar_type(), " on ", param.device(), " now): a torch::load into the wrapper, a to() of another "
                "dtype or device, or a set_data since then replaced its gradient accumulator, so its gradient would no "
                "longer be averaged over the ranks. Load, move and cast the module before wrapping it, or load weights "
                "after wrapping with lockstep::load_safetensors on every rank.");
  }
}

void Reducer::prepare_for_backward(bool sync) {
  State& s = *state_;
  if (!sync && s.phase == State::Phase::Expecting) {
    // A synced forward's backward is still to come. As in PyTorch, a forward
    // under no_sync does not cancel it: that backward, which takes this
    // forward's gradients too, is reduced. Made Unsynced, it stayed local
    // on every rank, and the ranks stepped apart.
    return;
  }
  s.phase = sync ? State::Phase::Expecting : State::Phase::Unsynced;
  s.ready.assign(s.params.size(), 0);
  s.surprises.assign(s.params.size(), State::kNone);
  if (sync && !s.unsynced_surprises.empty()) {
    s.surprises = std::move(s.unsynced_surprises);
    s.unsynced_surprises.clear();
  }
  s.next_bucket = 0;
  if (sync && s.recording_order()) {
    s.ready_order.clear();
  }
  for (auto& b : s.buckets) {
    b.pending = b.params.size();
    b.result.reset();
    b.checked = false;
  }
}

void Reducer::shadow_backward() {
  State& s = *state_;
  s.shadowing = true;
  prepare_for_backward(true);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (!s.ready[i]) {
      s.writable_slot(i).zero_();
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
  if (phase != Phase::Idle && params[index].grad().defined()) {
    used_since_sync[index] = 1; // Note [Unused parameters]
  }
  if (phase == Phase::Unsynced) {
    if (static_recorded && static_unused[index]) {
      // Note [Static graph]: the accumulated .grad would stay local, as
      // what every rank left unused; the next synced backward reports it.
      unsynced_surprises.resize(params.size(), kNone);
      unsynced_surprises[index] = kGradientFromUnused;
    }
    return; // no_sync: .grad accumulates locally
  }
  TORCH_CHECK(
      phase == Phase::Expecting, where(), "parameter '", names[index],
      "' received a gradient, but no forward ran through DistributedDataParallel since the last reduction. "
      "Run forward through the DistributedDataParallel before each backward (one backward per forward), and "
      "use no_sync() to accumulate gradients over several passes.");
  if (!finalize_queued) {
    finalize_queued = true;
    backward_span = timeline::Span("backward");
    std::weak_ptr<State> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) {
        state->finalize_backward();
      }
    });
    if (static_recorded) {
      // Note [Static graph]: what the first iteration left without a
      // gradient is ready now, as backward starts (as c10d's): its .grad is
      // read here, not at forward, since a zero_grad() may come between.
      for (size_t i = 0; i < params.size(); ++i) {
        if (static_unused[i]) {
          copy_in_unused(i);
          mark_ready(i);
        }
      }
    }
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
  copy_in(index);
  mark_ready(index);
}

// The parameter's .grad into its bucket slot, divided where the built-in
// allreduce sums (rather than averages); zeros when it has none.
void Reducer::State::copy_in(size_t index) {
  auto& view = writable_slot(index);
  auto& grad = params[index].mutable_grad();
  torch::NoGradGuard no_grad;
  TORCH_CHECK(!grad.defined() || grad.layout() == torch::kStrided, where(), "parameter '", names[index],
              "' received a sparse gradient (an Embedding or EmbeddingBag with sparse(true)?), but "
              "DistributedDataParallel reduces dense gradients only. Construct that layer with sparse(false).");
  timeline::Span span([&] { return "copy-in bucket " + std::to_string(slot_of[index].first); },
                      view.numel() * static_cast<int64_t>(view.element_size()));
  // The built-in allreduce sums what the ranks put in: put in grad / divisor,
  // in the same pass as the copy, unless the backend divides the sum.
  const bool divide_in = !options.comm_hook() && !backend_averages(buckets[slot_of[index].first]);
  if (!grad.defined()) {
    view.zero_();
  } else if (grad.data_ptr() == view.data_ptr()) { // .grad is the slot (Note [Gradients that are bucket slots])
    if (divide_in) {
      view.div_(divisor);
    }
  } else {
    if (divide_in) {
      // 16-bit gradients are divided in float: 1/3 rounded to bfloat16 is
      // 0.333984, a bias of 0.2% on every gradient (float16: -0.024%), and
      // LibTorch 1.13 rounds a scalar to the tensor's dtype.
      const double scale = 1.0 / static_cast<double>(divisor);
      if (grad.scalar_type() == torch::kHalf || grad.scalar_type() == torch::kBFloat16) {
        view.copy_(grad.to(torch::kFloat).mul_(scale));
      } else {
        at::mul_out(view, grad, at::scalar_tensor(scale, grad.options()));
      }
    } else {
      view.copy_(grad);
    }
    if (options.gradient_as_bucket_view()) {
      grad = view; // zero_grad(set_to_none) or a stolen gradient replaced the view
    }
  }
}

// A parameter without a gradient in this backward: what no_sync accumulated
// goes in (Note [Unused parameters]). A globally unused parameter keeps its
// .grad: when that is its bucket slot, its value is kept to be put back; when
// it is a tensor of the caller's own (assigned by hand), the parameter keeps
// that tensor, and copy_out points it at the slot only if some rank used it.
void Reducer::State::copy_in_unused(size_t index) {
  torch::NoGradGuard no_grad;
  auto& view = writable_slot(index); // before `grad` below holds the slot too
  const auto grad = params[index].grad();
  const bool may_be_unused = options.find_unused_parameters() || options.static_graph();
  const bool is_slot = grad.defined() && grad.data_ptr() == view.data_ptr();
  if (may_be_unused && is_slot) {
    saved_grads[index] = grad.clone();
  }
  copy_in(index);
  if (may_be_unused && grad.defined() && !is_slot) {
    params[index].mutable_grad() = grad;
  }
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
    const bool flagged = flag_in_last_bucket() && next_bucket + 1 == buckets.size();
    if (flagged && !backward_ended) {
      return; // Note [Static graph]: the flag is known only once backward has ended
    }
    auto& bucket = buckets[next_bucket];
    const bool averaged = backend_averages(bucket);
    if (flagged) { // averaged, a count of the ranks that flagged still comes out
      bucket.buffer[bucket.numel].fill_(last_bucket_flag() * (averaged ? group.size() : 1));
    }
    bucket.allreduce_span =
        timeline::Span([&] { return "allreduce bucket " + std::to_string(next_bucket); }, bucket.bytes, "collectives");
    CollectiveTag tag(model_tag(model, 1 + static_cast<int64_t>(next_bucket))); // Note [Collective tags]
    if (options.comm_hook()) {
      GradBucket view{next_bucket, bucket.buffer, bucket.params, bucket.name, bucket.views,
                      next_bucket + 1 == buckets.size(), weak_from_this()};
      bucket.result = options.comm_hook()(group, view);
    } else {
      // The gradients were divided by the divisor on their way in, unless averaged.
      PlannedCollective planned(plan, static_cast<int64_t>(next_bucket));
      bucket.result = comm_hooks::pending(
          group.allreduce_async({bucket.buffer}, averaged ? ReduceOp::Avg : ReduceOp::Sum, "allreduce of " + bucket.name),
          bucket.buffer);
    }
    TORCH_CHECK(bucket.result != nullptr, where(), "the communication hook returned no result for ", bucket.name, ".");
    ++next_bucket;
  }
}

} // namespace detail
} // namespace lockstep
