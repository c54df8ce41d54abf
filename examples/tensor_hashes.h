#pragma once

// The hashes that lockstep-train's checkpoints store and its runs print: of a
// model's parameters and buffers, and of an optimizer's state, bit for bit.

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

/// FNV-1a over the bytes of `tensors`, in order: equal hashes mean bitwise
/// equal contents (the restart tests compare models by it).
inline uint64_t content_hash(const std::vector<torch::Tensor>& tensors) {
  uint64_t hash = 1469598103934665603ull;
  for (const auto& t : tensors) {
    auto bytes = t.detach().contiguous().to(torch::kCPU);
    const auto* p = static_cast<const unsigned char*>(bytes.data_ptr());
    for (size_t i = 0; i < bytes.nbytes(); ++i) {
      hash = (hash ^ p[i]) * 1099511628211ull;
    }
  }
  return hash;
}

/// Every parameter and buffer of `module`, in registration order.
inline std::vector<torch::Tensor> model_tensors(torch::nn::Module& module) {
  auto all = module.parameters();
  for (const auto& b : module.buffers()) {
    all.push_back(b);
  }
  return all;
}

/// `param`'s entry in an optimizer's state map. LibTorch 1.x keys the map by
/// the parameter's address as text, 2.x by the address itself; the map's key
/// type says which.
template <typename Map>
auto find_state(Map& state, const torch::Tensor& param) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return state.find(key.str());
  } else {
    return state.find(param.unsafeGetTensorImpl());
  }
}

/// The optimizer's per-parameter state tensors (SGD's momentum, Adam's
/// and AdamW's moments), in parameter order, each with the parameter it belongs to.
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> optimizer_tensors(torch::optim::Optimizer& optimizer) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> all;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      auto found = find_state(optimizer.state(), param);
      if (found == optimizer.state().end()) {
        continue;
      }
      if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(found->second.get())) {
        all.emplace_back(param, sgd->momentum_buffer());
      } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(found->second.get())) {
        all.emplace_back(param, adam->exp_avg());
        all.emplace_back(param, adam->exp_avg_sq());
      } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(found->second.get())) {
        all.emplace_back(param, adamw->exp_avg());
        all.emplace_back(param, adamw->exp_avg_sq());
      }
    }
  }
  return all;
}

inline uint64_t optimizer_hash(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> tensors;
  for (const auto& [param, state] : optimizer_tensors(optimizer)) {
    tensors.push_back(state);
  }
  return content_hash(tensors);
}

// A uint64 in an int64 tensor, bit for bit.
inline torch::Tensor hash_tensor(uint64_t hash) {
  int64_t bits = 0;
  std::memcpy(&bits, &hash, sizeof(bits));
  return torch::tensor(bits);
}

} // namespace examples
} // namespace lockstep
