// DataParallel's deterministic mode: the micro-batches run one after another
// through the wrapped module, and their gradients are summed exactly, as on
// one rank of DistributedDataParallel (Note [The same bits at any world
// size] in src/deterministic/micro_batch_step.cpp). The replicas do not run
// them: threads share the CPU's default generator, which each micro-batch
// seeds for its own dropout, and a sum split over replicas would be no
// faster to make exact than one over ranks.

#include <lockstep/data_parallel.h>

#include "deterministic/whole_parameters.h"
#include "util/unique_tensors.h"

#include <torch/torch.h>

#include <algorithm>

namespace lockstep {
namespace detail {

DataParallelDeterminism::DataParallelDeterminism(torch::nn::Module& module, const DataParallelOptions& options) {
  // Each parameter once (a tied one is listed under each of its names), and
  // the frozen ones too: one unfrozen later is summed exactly as the others,
  // and one that gets no gradient keeps none.
  params_ = unique_tensors(module.parameters());
  const std::string where = "lockstep::DataParallel (deterministic): ";
  check_exactly_summable(module, where, /*frozen_too=*/true); // a frozen one may train later, and is summed
  TORCH_CHECK(std::any_of(params_.begin(), params_.end(), [](const auto& p) { return p.requires_grad(); }), where,
              "the module has no parameter that requires a gradient.");
  MicroBatchConfig config;
  config.micro_batches = options.micro_batches();
  config.micro_batch_size = options.micro_batch_size();
  config.seed = options.seed();
  step_ = std::make_unique<MicroBatchStep>(module, ProcessGroup(), config, options.devices().at(0), where);
}

DataParallelDeterminism::~DataParallelDeterminism() = default;

double DataParallelDeterminism::backward_micro_batches(int64_t step,
                                                       const std::function<torch::Tensor(int64_t)>& loss_of) {
  return step_whole_parameters(*step_, params_, step, loss_of, "deterministic DataParallel");
}

bool DataParallelDeterminism::forward_alone(int64_t batch) const {
  step_->check_forward(batch);
  return torch::GradMode::is_enabled();
}

} // namespace detail
} // namespace lockstep
