#pragma once

/// \file
/// Mixed precision for LibTorch: an autocast guard (Python's torch.autocast
/// as a scope) and a gradient scaler (torch.amp.GradScaler) that, given a
/// process group, makes every rank step or skip together. See Note [Mixed
/// precision] in src/amp.cpp, and docs/design.md for which combination suits
/// which case.

#include <lockstep/process_group.h>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <utility>

namespace lockstep {

/// While it lives, operators on `device_type` run under autocast to `dtype`
/// (torch::kBFloat16 or torch::kHalf), as inside Python's
/// `with torch.autocast(device_type, dtype)`. Guards nest: each one restores
/// the state it found, and the outermost clears the cast cache (the
/// low-precision copies of the weights autocast made, which an optimizer
/// step makes stale). The state is the calling thread's; DataParallel's
/// replicas run under their caller's. Unsupported device types and dtypes
/// are refused here rather than silently running in fp32; a CUDA guard on a
/// machine without CUDA warns and is off, as Python's is. Without
/// `cache_enabled`, the cast cache stays as the guard found it (on, unless
/// an enclosing guard turned it off), as Python's cache_enabled=None.
/// A guard ended before one made inside it hands what it restores to that
/// one, so the state it found comes back when the last of them ends. A
/// guard ended on another thread than the one that made it cannot restore
/// that thread's state: it is an error (printed, if an exception is
/// already unwinding).
class AutocastGuard {
 public:
  /// Turns autocast to `dtype` on for `device_type` (torch::kCPU or
  /// torch::kCUDA), or off with `enabled` false, and the cast cache on or off
  /// as `cache_enabled` says (unset: as it was). A device type this LibTorch
  /// has no autocast for, another dtype, and float16 on the CPU before
  /// PyTorch 2.4 are errors.
  AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled = true,
                std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastGuard() noexcept(false);
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool hand_over_to_inner();
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_enabled_;
  uint64_t thread_; // the making thread's number, never reused (a std::thread::id can be)
};

/// Options of GradScaler, with torch.amp.GradScaler's defaults.
struct GradScalerOptions {
  /// The scale of the first iteration.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after growth_interval steps without inf or NaN.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this after a step skipped for inf or NaN.
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Steps without inf or NaN between two growths.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: every call passes through (scale() returns its input, step() steps).
  TORCH_ARG(bool, enabled) = true;
  /// The ranks that must agree on whether a gradient overflowed: one
  /// allreduce (Max) of one number per step. Needed where ranks see
  /// different gradients: FullyShardedDataParallel's shards. unscale_()
  /// (which step() calls unless you did) is then collective: every rank
  /// calls it for the same optimizers in the same order. The default, a
  /// group of one, agrees with itself at no cost.
  TORCH_ARG(ProcessGroup, group);
};

/// torch.amp.GradScaler for LibTorch.
///
/// ```
/// scaler.scale(loss).backward();
/// scaler.unscale_(optimizer);              // optional, before clipping
/// bool stepped = scaler.step(optimizer);   // skipped on inf or NaN
/// scaler.update();
/// ```
///
/// Gradients in float16 are refused by unscale_ (keep fp32 master weights).
class GradScaler {
 public:
  /// A scaler with `options`; an init_scale, growth_factor, backoff_factor or
  /// growth_interval out of range is an error naming it.
  explicit GradScaler(GradScalerOptions options = {});

  /// `outputs` times the scale. The scale lives on the device of the first
  /// tensor scaled.
  torch::Tensor scale(const torch::Tensor& outputs);
  /// Divides the optimizer's gradients by the scale, in place, and records
  /// whether any is inf or NaN. At most once per optimizer between updates.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales (unless unscale_ did), agrees with the group, and steps unless
  /// a gradient of any rank was inf or NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Backs the scale off after a skipped step, grows it after
  /// growth_interval good ones, and ends the iteration. The scale stays at
  /// float32's smallest normal number (1.2e-38) or above, where PyTorch's
  /// falls to 0 after some 140 skipped steps in a row and never grows back.
  void update();
  /// Sets the scale to `new_scale` (from 1.2e-38 to 3.4e38) and ends the
  /// iteration.
  void update(double new_scale);

  /// Sets growth_interval (from 1 to 2^31 - 1), as torch.amp.GradScaler's
  /// set_growth_interval: a resumed run's own setting over the loaded one.
  /// Good steps counted so far stay, up to the new interval less one.
  void set_growth_interval(int64_t interval);

  /// The current scale; 1.0 when disabled.
  double get_scale() const;
  /// Good steps since the last growth or backoff.
  int64_t growth_tracker() const;
  /// Whether the scaler is on (GradScalerOptions::enabled).
  bool is_enabled() const {
    return options_.enabled();
  }
  /// The options it was made with.
  const GradScalerOptions& options() const {
    return options_;
  }

  /// Writes the scale, the growth tracker and the factors, under
  /// torch.amp.GradScaler.state_dict()'s names.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote; a missing entry is an error naming it.
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    torch::Tensor found_inf; // 1 element, float, on the scale's device; agreed over the group
    bool no_gradients = false; // no parameter had a gradient (on some rank of the group)
  };

  void check_scaled(const char* call) const;
  // Shards split over more ranks than the group has would not agree on found-inf.
  void check_group_covers_shards(torch::optim::Optimizer& optimizer) const;
  // The group's largest and smallest scale, from the found-inf agreement, are one.
  void check_scales_agree(float largest, float smallest) const;
  PerOptimizer& state_of(torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  torch::Tensor scale_;          // float, 1 element; undefined until the first scale()
  torch::Tensor growth_tracker_; // int32, 1 element, beside scale_
  int32_t init_growth_tracker_ = 0; // growth_tracker_'s value when scale() creates it (load() sets it)
  std::map<const torch::optim::Optimizer*, PerOptimizer> optimizers_;
};

namespace detail {
/// One update of the scale, as ATen's _amp_update_scale_ kernel computes it
/// (in float): back off on found_inf, not below float32's smallest normal
/// number (GradScaler::update() keeps that floor after the kernel too), grow
/// after growth_interval good steps unless that overflows. Returns {scale,
/// growth_tracker}.
std::pair<float, int32_t> next_scale(float scale, int32_t growth_tracker, bool found_inf, double growth_factor,
                                     double backoff_factor, int64_t growth_interval);
} // namespace detail

} // namespace lockstep
