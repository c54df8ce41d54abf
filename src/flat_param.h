#pragma once

// Internal: what FullyShardedDataParallel keeps per unit and dtype, shared by
// src/fully_sharded.cpp and src/sharded_checkpoint.cpp.

#include <lockstep/detail/sharded_core.h>

#include "torch_compat.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

struct FlatParam {
  std::string unit; // "" for the root
  torch::ScalarType dtype = torch::kFloat;
  torch::Device device = torch::kCPU;
  std::vector<torch::Tensor> params; // the module's own
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes; // the parameters' own, kept while they are empty
  ShardLayout layout;
  torch::Tensor shard; // registered on the wrapper
  torch::Tensor full; // the gathered buffer; its storage is released while sharded
  bool gathered = false;
  std::vector<char> ready;
  size_t ready_count = 0;
  torch::Tensor reduced;
  std::shared_ptr<Work> reduce;
  int64_t reduce_start_us = 0;
  std::vector<NodePtr> accumulators;
  std::vector<uintptr_t> hook_keys;

  torch::TensorOptions options() const {
    return torch::TensorOptions().dtype(dtype).device(device);
  }
};

} // namespace detail
} // namespace lockstep
