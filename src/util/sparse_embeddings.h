#pragma once

// Internal: the layers whose gradient is sparse. FullyShardedDataParallel
// and deterministic mode sum dense gradients only, and refuse them when the
// module is wrapped, where backward would fail later naming nothing.

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

#include <optional>
#include <string>

namespace lockstep {
namespace detail {

/// The path of `module`'s first Embedding or EmbeddingBag with sparse(true)
/// and a trainable weight, if any ("" for `module` itself).
inline std::optional<std::string> first_sparse_embedding(torch::nn::Module& module) {
  for (const auto& named : module.named_modules("", /*include_self=*/true)) {
    const auto* m = named.value().get();
    if (const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(m)) {
      if (embedding->options.sparse() && embedding->weight.requires_grad()) {
        return named.key();
      }
    } else if (const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(m)) {
      if (bag->options.sparse() && bag->weight.requires_grad()) {
        return named.key();
      }
    }
  }
  return std::nullopt;
}

} // namespace detail
} // namespace lockstep
