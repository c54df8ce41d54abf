#include <lockstep/amp.h>

#include "comm/collective_fingerprint.h"
#include "util/autocast_state.h"
#include "util/shard_registry.h"
#include "util/torch_compat.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorOptions.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// Autocast is thread-local state in ATen: an enabled flag and a dtype per
// device type, a nesting count, and a cache of the low-precision copies it
// made of fp32 leaf weights. Python's torch.autocast sets the first two,
// counts the nesting, and clears the cache when the outermost scope ends;
// AutocastGuard does the same through src/util/torch_compat.h, which hides that
// 1.13 has one function per device type where 2.4 and later take the type.
//
// The cache is why the scope matters. It is keyed by the weight's
// TensorImpl, so after an optimizer step changes a weight in place, a cache
// that was not cleared hands back the old copy: a silently wrong forward.
// DataParallel's replicas run on threads of their own. at::ThreadLocalState
// carries the enabled flags there (and, in 2.x, the dtypes), but not the
// nesting. In 1.13 the cache is per thread too, and a replica thread, which
// never ends a scope of its own, kept its casts from one step to the next:
// measured, every replica computed with the weights of the step before
// (test ReplicaThreadsDropTheirCastCacheAfterEachStep). So each replica runs
// inside a ReplicaAutocast: its caller's state, dtypes included, one
// nesting level, and a cleared cache at the end.
//
// GradScaler follows torch.amp.GradScaler, with ATen's kernels where this
// LibTorch has them for the gradients' device (CUDA; CPU from 2.x) and the
// same arithmetic in plain tensor ops where it does not (1.13's CPU), asked
// of the dispatcher rather than decided by version. What it adds is
// agreement: under FullyShardedDataParallel each rank unscales only its own
// shard of the gradients, so only the rank that holds an overflowed element
// sees it. Left alone, that rank would skip its step and the others would
// take theirs, and the shards would drift apart for good. unscale_ therefore
// ends with one allreduce (Max) of found-inf over the options' group, and
// every rank steps or skips together, and backs its scale off together.
// It carries the scale and its negation too: ranks of unlike scales (a
// scaler load()ed on rank 0 alone) are an error on every rank.
// A scaler left with its default group of one would not agree, so unscale_
// refuses shards split over more ranks than its group has (shard_registry.h).

namespace lockstep {

namespace detail {
namespace {

struct ShardRegistry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, int> world;
};

ShardRegistry& shard_registry() {
  static auto* registry = new ShardRegistry(); // never destroyed: wrappers may outlive static destruction
  return *registry;
}

} // namespace

void note_shard(const c10::TensorImpl* shard, int world) {
  auto& r = shard_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.world[shard] = world;
}

void forget_shard(const c10::TensorImpl* shard) {
  auto& r = shard_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.world.erase(shard);
}

int shard_world(const c10::TensorImpl* tensor) {
  auto& r = shard_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.world.find(tensor);
  return it == r.world.end() ? 1 : it->second;
}

} // namespace detail

namespace {

// This thread's live AutocastGuards, outermost first (Note [Autocast guards
// ended out of order]).
std::vector<AutocastGuard*>& live_autocast_guards() {
  thread_local std::vector<AutocastGuard*> live;
  return live;
}

// A number for this thread that no other thread of the process has had.
uint64_t this_thread_number() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t number = next++;
  return number;
}

} // namespace

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled,
                             std::optional<bool> cache_enabled)
    : device_type_(device_type) {
  // DataParallel's replicas and lockstep::checkpoint's recomputation carry a
  // thread's autocast state for these two only (detail::AutocastState).
  TORCH_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
              "lockstep::AutocastGuard: lockstep runs autocast for CPU and CUDA tensors, not ", device_type,
              " ones: DataParallel's replicas and lockstep::checkpoint's recomputation would run without it; use "
              "torch::kCPU or torch::kCUDA");
  // A disabled guard's dtype is never used (`AutocastGuard g(kCPU, amp ? kBFloat16 : kFloat, amp)`, as
  // torch.autocast takes it): it keeps the dtype it found.
  TORCH_CHECK(!enabled || dtype == c10::kBFloat16 || dtype == c10::kHalf, "lockstep::AutocastGuard: dtype ", dtype,
              " is not a lower precision autocast can run in; pass torch::kBFloat16 or torch::kHalf");
  TORCH_CHECK(!enabled || device_type != c10::DeviceType::CPU || dtype != c10::kHalf || detail::kCpuAutocastTakesHalf,
              "lockstep::AutocastGuard: CPU autocast to float16 needs PyTorch 2.4 or later, and this LibTorch is ",
              TORCH_VERSION, "; pass torch::kBFloat16 for the CPU");
  // As Python's torch.autocast("cuda") without CUDA: said, and off. CPU tensors would run in their own dtypes.
  if (enabled && device_type == c10::DeviceType::CUDA && !torch::cuda::is_available()) {
    TORCH_WARN_ONCE("lockstep::AutocastGuard: autocast for CUDA, but this machine has no CUDA device, so the guard is "
                    "off and CPU tensors run in their own dtypes. For CPU autocast, pass torch::kCPU.");
    enabled = false;
  }
  previous_enabled_ = detail::autocast_enabled(device_type);
  previous_dtype_ = detail::autocast_dtype(device_type);
  previous_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  detail::set_autocast_enabled(device_type, enabled);
  detail::set_autocast_dtype(device_type, enabled ? dtype : previous_dtype_);
  at::autocast::set_autocast_cache_enabled(cache_enabled.value_or(previous_cache_enabled_));
  at::autocast::increment_nesting();
  thread_ = this_thread_number();
  live_autocast_guards().push_back(this);
}

// Note [Autocast guards ended out of order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autocast's state is the thread's. A guard restores what it found; ended
// before a guard made inside it (two std::optional guards reset in the
// order they were made), it would restore its state while the inner one
// lives, and the inner one's end would then restore the outer one's
// setting: the thread left under autocast for good. So the thread's live
// guards are kept in order, and one that is not the innermost hands what
// it would restore to the next inner guard of its device type (the cache
// flag to the next inner guard of any), and changes nothing now. A guard
// ended on another thread can reach neither that thread's state nor its
// list: that is an error.
bool AutocastGuard::hand_over_to_inner() {
  auto& live = live_autocast_guards();
  const auto it = std::find(live.begin(), live.end(), this);
  TORCH_INTERNAL_ASSERT(it != live.end(), "an AutocastGuard missing from its thread's list");
  if (it + 1 == live.end()) {
    live.erase(it);
    return false;
  }
  (*(it + 1))->previous_cache_enabled_ = previous_cache_enabled_;
  const auto same = std::find_if(it + 1, live.end(), [&](auto* g) { return g->device_type_ == device_type_; });
  if (same != live.end()) {
    (*same)->previous_enabled_ = previous_enabled_;
    (*same)->previous_dtype_ = previous_dtype_;
  } else {
    detail::set_autocast_enabled(device_type_, previous_enabled_);
    detail::set_autocast_dtype(device_type_, previous_dtype_);
  }
  live.erase(it);
  at::autocast::decrement_nesting(); // an inner guard lives: never the last
  return true;
}

AutocastGuard::~AutocastGuard() noexcept(false) {
  if (this_thread_number() != thread_) {
    const char* message = "lockstep::AutocastGuard: destroyed on another thread than the one that made it, so it "
                          "cannot restore that thread's autocast state, which stays on. End each guard on the "
                          "thread that made it (autocast's state is per thread).";
    if (std::uncaught_exceptions() > 0) {
      std::fprintf(stderr, "%s\n", message);
      return;
    }
    TORCH_CHECK(false, message);
  }
  if (hand_over_to_inner()) {
    return;
  }
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  detail::set_autocast_enabled(device_type_, previous_enabled_);
  detail::set_autocast_dtype(device_type_, previous_dtype_);
  at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
}

namespace detail {

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu_enabled = autocast_enabled(c10::DeviceType::CPU);
  s.cuda_enabled = autocast_enabled(c10::DeviceType::CUDA);
  s.cpu_dtype = autocast_dtype(c10::DeviceType::CPU);
  s.cuda_dtype = autocast_dtype(c10::DeviceType::CUDA);
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return s;
}

void AutocastState::apply() const {
  set_autocast_enabled(c10::DeviceType::CPU, cpu_enabled);
  set_autocast_enabled(c10::DeviceType::CUDA, cuda_enabled);
  set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype);
  set_autocast_dtype(c10::DeviceType::CUDA, cuda_dtype);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

ReplicaAutocast::ReplicaAutocast(const AutocastState& caller) : previous_(AutocastState::current()) {
  caller.apply();
  at::autocast::increment_nesting();
}

ReplicaAutocast::~ReplicaAutocast() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  previous_.apply();
}

std::pair<float, int32_t> next_scale(float scale, int32_t growth_tracker, bool found_inf, double growth_factor,
                                     double backoff_factor, int64_t growth_interval) {
  if (found_inf) { // Note [The loss scale's floor]
    return {std::max(static_cast<float>(scale * backoff_factor), std::numeric_limits<float>::min()), 0};
  }
  const int32_t successful = growth_tracker + 1;
  if (successful < growth_interval) {
    return {scale, successful};
  }
  const auto grown = static_cast<float>(scale * growth_factor);
  return {std::isfinite(grown) ? grown : scale, 0}; // never grow past float's range into inf
}

} // namespace detail

namespace {

// Whether ATen has `op` for tensors like `t` (Note [Mixed precision]).
bool aten_has_kernel(const char* op, const torch::Tensor& t) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, "");
  return handle.hasKernelForDispatchKey(c10::computeDispatchKey(t.scalar_type(), c10::kStrided, t.device()));
}

// Gradients of one device and dtype, with the found-inf flag of that device.
struct GradGroup {
  torch::Device device;
  torch::ScalarType dtype;
  std::vector<torch::Tensor> grads;
};

// Each parameter once: LibTorch's Module::parameters() lists a tensor held
// under two names (tied weights) twice, and its gradient must be unscaled
// once, not divided by the scale twice.
std::vector<GradGroup> gradients_by_device_and_dtype(torch::optim::Optimizer& optimizer) {
  std::vector<GradGroup> groups;
  std::unordered_set<const c10::TensorImpl*> seen;
  size_t index = 0;
  for (auto& param_group : optimizer.param_groups()) {
    for (auto& p : param_group.params()) {
      ++index;
      if (!p.grad().defined() || !seen.insert(p.unsafeGetTensorImpl()).second) {
        continue;
      }
      auto g = p.grad().is_sparse() ? p.grad()._values() : p.grad();
      TORCH_CHECK(g.scalar_type() != torch::kHalf, "lockstep::GradScaler::unscale_: the gradient of the optimizer's "
                  "parameter ", index, " (of ", p.sizes(), ") is float16: unscaling it in float16 loses what the "
                  "scale protected. Keep the parameters the optimizer steps in float32: autocast casts them for the "
                  "forward, and FullyShardedDataParallel's param_dtype keeps float32 shards");
      auto it = std::find_if(groups.begin(), groups.end(), [&](const GradGroup& group) {
        return group.device == g.device() && group.dtype == g.scalar_type();
      });
      if (it == groups.end()) {
        groups.push_back(GradGroup{g.device(), g.scalar_type(), {}});
        it = groups.end() - 1;
      }
      it->grads.push_back(g);
    }
  }
  return groups;
}

// Multiplies `grads` by inv_scale and sets found_inf to 1 where one holds an
// inf or NaN: ATen's kernel where it has one, else the same in tensor ops.
void check_and_unscale(std::vector<torch::Tensor>& grads, torch::Tensor& found_inf, const torch::Tensor& inv_scale) {
  if (aten_has_kernel("aten::_amp_foreach_non_finite_check_and_unscale_", grads.front())) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    return;
  }
  for (auto& g : grads) {
    if (!torch::isfinite(g).all().item<bool>()) {
      found_inf.fill_(1.0);
    }
    g.mul_(inv_scale.reshape({})); // a 0-dim gradient cannot take a [1] in place
  }
}

} // namespace

namespace {

// The scale lives in a float32 tensor: a double beyond float's range
// passed a check in double, then failed in ATen's fill_ with a message
// that named neither the argument nor the call. Below float's smallest
// normal number the scale rounds to 0 or its reciprocal, the unscaling
// factor, to inf: every step would be skipped, and backing off keeps it so.
bool valid_scale(double scale) {
  return std::isfinite(scale) && scale >= std::numeric_limits<float>::min() &&
      scale <= std::numeric_limits<float>::max();
}

constexpr const char* kScaleRange = "must be a finite number from float32's smallest normal (1.2e-38) to its "
                                    "largest (3.4e38)";

// `where` is the constructor, or load() with the archive's values.
void check_options(const GradScalerOptions& o, const char* where) {
  TORCH_CHECK(valid_scale(o.init_scale()), where, "init_scale ", o.init_scale(), " ", kScaleRange);
  TORCH_CHECK(std::isfinite(o.growth_factor()) && o.growth_factor() > 1.0, where, "growth_factor ",
              o.growth_factor(), " must be above 1");
  TORCH_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1.0, where, "backoff_factor ",
              o.backoff_factor(), " must be between 0 and 1");
  TORCH_CHECK(o.growth_interval() > 0 && o.growth_interval() <= INT32_MAX, where, "growth_interval ",
              o.growth_interval(), " must be a positive number of steps");
}

// Note [The loss scale's floor]: read only on a skipped step, which has
// already waited for its check.
void warn_at_the_floor(const torch::Tensor& scale_tensor, double backoff_factor) {
  const double scale = scale_tensor.item<float>();
  if (scale * backoff_factor < std::numeric_limits<float>::min()) {
    TORCH_WARN_ONCE("lockstep::GradScaler: the gradients hold inf or NaN at a loss scale of ", scale, ", float32's "
                    "smallest normal number or near it, where no float16 overflow is left: the loss or a parameter "
                    "is likely inf or NaN (a learning rate too large, a log of 0, data with NaN). Steps are skipped "
                    "while it lasts, and the scale grows back once gradients are finite.");
  }
}

} // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)) {
  check_options(options_, "lockstep::GradScaler: ");
}

torch::Tensor GradScaler::scale(const torch::Tensor& outputs) {
  if (!options_.enabled()) {
    return outputs;
  }
  TORCH_CHECK(outputs.defined() && outputs.is_floating_point(), "lockstep::GradScaler::scale: the tensor to scale "
              "must be a defined floating-point tensor (the loss), not ", outputs.defined() ? outputs.toString() : "undefined");
  if (!scale_.defined()) {
    scale_ = torch::full({1}, options_.init_scale(), torch::dtype(torch::kFloat).device(outputs.device()));
    growth_tracker_ = torch::full({1}, init_growth_tracker_, torch::dtype(torch::kInt).device(outputs.device()));
  }
  // As PyTorch, by the [1]-shaped float32 scale, so that type promotion
  // makes a float16 tensor's product float32: by a 0-dim scale it would stay
  // float16, where a value of 1 times 65536 is inf, and whatever reduces it
  // after (a mean's 1/N) would run in float16. A 0-dim loss stays 0-dim (and
  // becomes float32 all the same).
  const auto scale = scale_.to(outputs.device(), /*non_blocking=*/true);
  return outputs.dim() == 0 ? outputs * scale.reshape({}) : outputs * scale;
}

void GradScaler::check_scaled(const char* call) const {
  TORCH_CHECK(scale_.defined(), "lockstep::GradScaler::", call, ": nothing was scaled yet; call "
              "scaler.scale(loss).backward() before scaler.", call, "()");
}

GradScaler::PerOptimizer& GradScaler::state_of(torch::optim::Optimizer& optimizer) {
  return optimizers_[&optimizer];
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return;
  }
  check_scaled("unscale_");
  auto& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::Unscaled, "lockstep::GradScaler::unscale_: unscale_() was already called for "
              "this optimizer since the last update(); call it once per optimizer per iteration");
  TORCH_CHECK(state.stage != Stage::Stepped, "lockstep::GradScaler::unscale_: unscale_() is being called after "
              "step(); call it between backward() and step()");
  check_group_covers_shards(optimizer);
  const auto inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  auto groups = gradients_by_device_and_dtype(optimizer); // before found_inf: a refusal records no check
  state.found_inf = torch::zeros({1}, scale_.options().dtype(torch::kFloat));
  for (auto& group : groups) {
    auto found = torch::zeros({1}, torch::dtype(torch::kFloat).device(group.device));
    check_and_unscale(group.grads, found, inv_scale.to(group.device));
    state.found_inf.add_(found.to(state.found_inf.device()));
  }
  // Note [Mixed precision]: every rank steps or skips together, and an
  // optimizer with no gradient on some rank is refused on every rank.
  state.no_gradients = groups.empty();
  const auto& group = options_.group();
  if (group.size() > 1) {
    // The maxima of the scale and of its negation: whether the ranks' scales are one.
    const auto scale = scale_.reshape({1});
    auto agreed = torch::cat({state.found_inf, torch::full({1}, state.no_gradients ? 1.0 : 0.0, scale.options()), scale,
                              -scale});
    if (!group.supports(Collective::Allreduce, torch::kFloat, agreed.device())) {
      agreed = agreed.cpu();
    }
    std::vector<torch::Tensor> params; // Note [Collective tags]: optimizers unscaled in another order
    for (auto& param_group : optimizer.param_groups()) {
      params.insert(params.end(), param_group.params().begin(), param_group.params().end());
    }
    detail::CollectiveTag tag(detail::optimizer_tag(params));
    group.allreduce_async({agreed}, ReduceOp::Max, "GradScaler's found-inf agreement (unscale_)")->wait();
    state.found_inf.copy_(agreed.narrow(0, 0, 1));
    const auto words = agreed.cpu(); // one copy from a GPU for the three read here
    state.no_gradients = words[1].item<float>() != 0;
    check_scales_agree(words[2].item<float>(), -words[3].item<float>());
  }
  state.stage = Stage::Unscaled;
}

void GradScaler::check_scales_agree(float largest, float smallest) const {
  TORCH_CHECK(largest == smallest, "lockstep::GradScaler::unscale_: rank ", options_.group().rank(), " of the scaler's "
              "group scaled its loss by ", scale_.item<float>(), ", and the ranks' scales range from ", smallest, " to ",
              largest, ": each rank would divide the averaged gradients by its own scale, and the ranks' parameters "
              "would drift apart. Give every rank the same GradScalerOptions, and load() the scaler's state on every "
              "rank, not on rank 0 alone.");
}

void GradScaler::check_group_covers_shards(torch::optim::Optimizer& optimizer) const {
  const int ranks = options_.group().size();
  for (auto& param_group : optimizer.param_groups()) {
    for (auto& p : param_group.params()) {
      const int world = detail::shard_world(p.unsafeGetTensorImpl());
      TORCH_CHECK(world <= ranks, "lockstep::GradScaler::unscale_: the optimizer steps the shards of a "
                  "FullyShardedDataParallel over ", world, " ranks, but this scaler's group has ", ranks, ": an "
                  "overflow in one rank's shard would skip the step on that rank only, and the ranks' parameters "
                  "would drift apart. Give the scaler the model's group: GradScaler(GradScalerOptions().group(group)).");
    }
  }
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  auto& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::Stepped, "lockstep::GradScaler::step: step() was already called for this "
              "optimizer since the last update(); call update() once per iteration, after the steps");
  if (state.stage == Stage::Ready) {
    unscale_(optimizer);
  }
  // As PyTorch's "No inf checks were recorded for this optimizer": stepping
  // it would check nothing, and update() would count a good step.
  TORCH_CHECK(!state.no_gradients, "lockstep::GradScaler::step: no parameter of the optimizer has a gradient",
              options_.group().size() > 1 ? " on some rank of the scaler's group" : "", ", so there is nothing to "
              "check for inf or to step. Run scaler.scale(loss).backward() before scaler.step(optimizer); an optimizer "
              "none of whose parameters took part in the loss must not be stepped this iteration.");
  const bool overflowed = state.found_inf.item<float>() != 0;
  if (!overflowed) {
    optimizer.step();
  } else {
    warn_at_the_floor(scale_, options_.backoff_factor());
  }
  state.stage = Stage::Stepped;
  return !overflowed;
}

// Note [The loss scale's floor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each skipped step halves the scale (backoff_factor). PyTorch lets it fall
// below float32's smallest normal number after some 140 skipped steps in a
// row from 65536: its reciprocal, the unscaling factor, is then inf, every
// gradient unscales to inf or NaN, and every later step is skipped, even
// once the cause (a stretch of bad data, a spike) has passed, since a scale
// of 0 never grows back. So update() keeps the scale at float32's smallest
// normal number or above, and step() warns once when a skipped step finds it
// there: at such a scale float16 gradients underflow to 0 rather than
// overflow, so the cause is a loss or parameter that is not finite. A run
// whose gradients are finite again grows the scale back, one growth_factor
// per growth_interval good steps.
void GradScaler::update() {
  if (!options_.enabled()) {
    return;
  }
  check_scaled("update");
  torch::Tensor found_inf;
  for (auto& entry : optimizers_) {
    if (entry.second.found_inf.defined() && !entry.second.no_gradients) {
      found_inf = found_inf.defined() ? found_inf + entry.second.found_inf : entry.second.found_inf.clone();
    }
  }
  TORCH_CHECK(found_inf.defined(), "lockstep::GradScaler::update: no optimizer with gradients was unscaled or "
              "stepped since the last update(); call scaler.scale(loss).backward(), then scaler.step(optimizer), "
              "before scaler.update()");
  const auto& o = options_;
  if (aten_has_kernel("aten::_amp_update_scale_", scale_)) {
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf, o.growth_factor(), o.backoff_factor(),
                           o.growth_interval());
  } else {
    auto next = detail::next_scale(scale_.item<float>(), growth_tracker_.item<int32_t>(), found_inf.item<float>() != 0,
                                   o.growth_factor(), o.backoff_factor(), o.growth_interval());
    scale_.fill_(next.first);
    growth_tracker_.fill_(next.second);
  }
  // Note [The loss scale's floor]: on the device, without a wait.
  scale_.clamp_min_(std::numeric_limits<float>::min());
  optimizers_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) {
    return;
  }
  check_scaled("update");
  TORCH_CHECK(valid_scale(new_scale), "lockstep::GradScaler::update: new_scale ", new_scale, " ", kScaleRange);
  scale_.fill_(new_scale);
  optimizers_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<float>() : options_.init_scale();
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int32_t>() : init_growth_tracker_;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  if (!options_.enabled()) {
    return; // as torch.amp.GradScaler.state_dict(): a disabled scaler has no state
  }
  const auto number = [](double v) { return torch::tensor(v, torch::kDouble); };
  archive.write("scale", number(get_scale()), /*is_buffer=*/true);
  archive.write("growth_factor", number(options_.growth_factor()), true);
  archive.write("backoff_factor", number(options_.backoff_factor()), true);
  archive.write("growth_interval", number(static_cast<double>(options_.growth_interval())), true);
  archive.write("_growth_tracker", number(static_cast<double>(growth_tracker())), true);
}

void GradScaler::set_growth_interval(int64_t interval) {
  TORCH_CHECK(interval >= 1 && interval <= INT32_MAX, "lockstep::GradScaler::set_growth_interval: ", interval,
              " is not a number of steps; pass one from 1 to ", INT32_MAX, ".");
  options_.growth_interval(interval);
  const auto most = static_cast<int32_t>(interval - 1);
  init_growth_tracker_ = std::min(init_growth_tracker_, most);
  if (growth_tracker_.defined()) {
    growth_tracker_.clamp_max_(most);
  }
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  if (!options_.enabled()) {
    return;
  }
  const auto read = [&](const char* key) {
    torch::Tensor value;
    TORCH_CHECK(archive.try_read(key, value, /*is_buffer=*/true) && value.numel() == 1,
                "lockstep::GradScaler::load: the archive has no \"", key, "\": it was not written by an enabled "
                "GradScaler's save() (a disabled one saves nothing)");
    return value.item<double>();
  };
  double scale = read("scale");
  if (scale > 0 && scale < std::numeric_limits<float>::min()) { // Note [The loss scale's floor]
    TORCH_WARN("lockstep::GradScaler::load: the archive's scale ", scale, " is below float32's smallest normal "
               "number, which a scaler without a floor backs off to; it is loaded as ",
               std::numeric_limits<float>::min(), ".");
    scale = std::numeric_limits<float>::min();
  }
  const double growth_factor = read("growth_factor");
  const double backoff_factor = read("backoff_factor");
  const double interval = read("growth_interval");
  TORCH_CHECK(interval >= 1 && interval <= INT32_MAX && interval == std::floor(interval), "lockstep::GradScaler::load: "
              "the archive's growth_interval ", interval, " must be a positive number of steps");
  const auto growth_interval = static_cast<int64_t>(interval);
  const double tracker = read("_growth_tracker");
  auto loaded = options_;
  loaded.init_scale(scale).growth_factor(growth_factor).backoff_factor(backoff_factor).growth_interval(growth_interval);
  // A scale of 0 or NaN would skip every step from then on, without a word.
  check_options(loaded, "lockstep::GradScaler::load: the archive's ");
  TORCH_CHECK(tracker >= 0 && tracker < static_cast<double>(growth_interval), "lockstep::GradScaler::load: the "
              "archive's _growth_tracker ", tracker, " must count the good steps since the last growth, from 0 to "
              "growth_interval - 1 (", growth_interval - 1, ")");
  options_ = loaded;
  init_growth_tracker_ = static_cast<int32_t>(tracker);
  if (scale_.defined()) {
    scale_.fill_(scale);
    growth_tracker_.fill_(init_growth_tracker_);
  }
}

} // namespace lockstep
