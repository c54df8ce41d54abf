#pragma once

// Internal: a list of tensors with each tensor once, as a module's
// parameters() lists a parameter once per name it is registered under.

#include <ATen/core/Tensor.h>

#include <unordered_set>
#include <vector>

namespace lockstep {
namespace detail {

// Each tensor once, in first-seen order: a parameter registered under two
// submodules is one parameter (Python DDP's _build_params_for_reducer).
inline std::vector<size_t> first_occurrences(const std::vector<torch::Tensor>& tensors) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<size_t> kept;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (seen.insert(tensors[i].unsafeGetTensorImpl()).second) {
      kept.push_back(i);
    }
  }
  return kept;
}

inline std::vector<torch::Tensor> unique_tensors(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> kept;
  for (size_t i : first_occurrences(tensors)) {
    kept.push_back(tensors[i]);
  }
  return kept;
}

} // namespace detail
} // namespace lockstep
