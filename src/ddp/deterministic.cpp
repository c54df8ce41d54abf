// DistributedDataParallel's deterministic mode: this rank's micro-batches run
// alone and one int64 allreduce sums their gradients exactly (Note [The same
// bits at any world size] in src/deterministic/micro_batch_step.cpp).

#include <lockstep/distributed_data_parallel.h>

#include "comm/collective_fingerprint.h"
#include "deterministic/whole_parameters.h"

#include <torch/torch.h>

namespace lockstep {
namespace detail {

void DistributedCore::make_deterministic(std::vector<torch::Tensor> params, const DistributedOptions& options) {
  const std::string where = "lockstep::DistributedDataParallel (deterministic, rank " + std::to_string(group_.rank()) +
      " of " + std::to_string(group_.size()) + "): ";
  TORCH_CHECK(!options.comm_hook() && !options.gradient_as_bucket_view(), where, "deterministic(true) sums the "
              "gradients itself, exactly: it takes neither a comm_hook nor gradient_as_bucket_view. Leave them unset.");
  TORCH_CHECK(!options.find_unused_parameters() && !options.static_graph(), where, "deterministic(true) runs each "
              "micro-batch's backward whole and sums after it, a parameter no micro-batch used getting no gradient: "
              "find_unused_parameters and static_graph, options of the reducer it replaces, would change nothing. "
              "Leave them unset.");
  MicroBatchConfig config;
  config.micro_batches = options.micro_batches();
  config.micro_batch_size = options.micro_batch_size();
  config.seed = options.seed();
  micro_batches_ = std::make_unique<MicroBatchStep>(module_, group_, config, params.at(0).device(), where);
  exact_params_ = std::move(params);
}

double DistributedCore::backward_micro_batches(int64_t step,
                                               const std::function<torch::Tensor(int64_t)>& loss_of) {
  TORCH_CHECK(micro_batches_ != nullptr, "lockstep::DistributedDataParallel: rank ", group_.rank(),
              ": backward_micro_batches needs DistributedOptions().deterministic(true).micro_batches(V); this wrapper "
              "reduces in backward, as PyTorch's DDP.");
  check_still_frozen();
  CollectiveTag tag(model_tag(model_, 0)); // Note [Collective tags]
  return step_whole_parameters(*micro_batches_, exact_params_, step, loss_of, "deterministic DistributedDataParallel");
}

} // namespace detail
} // namespace lockstep
