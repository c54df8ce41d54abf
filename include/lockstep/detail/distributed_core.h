#pragma once

// Internal: the part of DistributedDataParallel that does not depend on the
// module's type (src/distributed_data_parallel.cpp).

#include <lockstep/detail/reducer.h>
#include <lockstep/process_group.h>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace lockstep {

struct DistributedOptions;

namespace detail {

/// The part of DistributedDataParallel that does not depend on the module's
/// type: checks, broadcasts and the reducer.
class DistributedCore {
 public:
  DistributedCore(torch::nn::Module& module, ProcessGroup group, const DistributedOptions& options);

  /// Buffers from rank 0 if asked, and the reducer told what the next
  /// backward must do.
  void before_forward();

  const ProcessGroup& group() const {
    return group_;
  }
  Reducer& reducer() {
    return *reducer_;
  }
  /// False inside no_sync(): forwards then make their backward skip reduction.
  bool sync() const {
    return sync_;
  }
  void set_sync(bool sync) {
    sync_ = sync;
  }

 private:
  bool sync_ = true;
  ProcessGroup group_;
  bool broadcast_buffers_;
  std::vector<torch::Tensor> buffers_;
  std::unique_ptr<Reducer> reducer_;
};

/// Checks that every rank has the same parameters (count, names, shapes,
/// dtypes, in order); a mismatch throws on every rank, naming the first
/// differing parameter and what rank 0 has.
void verify_same_parameters(const ProcessGroup& group, const std::vector<std::string>& names, const std::vector<torch::Tensor>& params);

/// Copies root's `tensors` into every rank's, one collective per dtype.
void broadcast_coalesced(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors, int root, const std::string& what);

} // namespace detail

} // namespace lockstep
