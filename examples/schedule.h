#pragma once

// lockstep-train's learning-rate schedule: --warmup-steps, then --schedule
// (constant, step or cosine).

#include "options.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace lockstep {
namespace examples {

// The learning rate of optimizer step `step` (from 0) of `total`: a linear
// warmup, then constant, divided by `gamma` every `step_epochs` epochs, or a
// cosine down to 0. A function of the step alone, so a resumed run follows
// the same schedule (Note [The schedule after a resume] in sampling.h).
inline double lr_at(const Config& c, int64_t step, int64_t steps_per_epoch, int64_t total) {
  if (step < c.warmup_steps) {
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  if (c.schedule == "step") {
    return c.lr * std::pow(c.gamma, static_cast<double>(step / std::max<int64_t>(1, steps_per_epoch) / c.step_epochs));
  }
  if (c.schedule == "cosine") {
    const double progress = static_cast<double>(step - c.warmup_steps) / std::max<int64_t>(1, total - c.warmup_steps);
    return c.lr * 0.5 * (1 + std::cos(M_PI * std::min(1.0, progress)));
  }
  return c.lr;
}

} // namespace examples
} // namespace lockstep
