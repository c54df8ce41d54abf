#pragma once

// Internal: deterministic mode's step for the wrappers whose every rank
// holds the whole parameters.

#include "deterministic/micro_batch_step.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// The step of a wrapper whose every rank holds the whole parameters
/// (DistributedDataParallel, DataParallel): `step`'s micro-batches run, their
/// gradients are summed exactly in int64 across ranks, and each of `params`
/// gets the mean as its .grad. Returns the mean loss. `who` names the wrapper in the
/// collectives' descriptions.
double step_whole_parameters(MicroBatchStep& micro_batches, std::vector<torch::Tensor>& params, int64_t step,
                             const std::function<torch::Tensor(int64_t)>& loss_of, const std::string& who);

} // namespace detail
} // namespace lockstep
