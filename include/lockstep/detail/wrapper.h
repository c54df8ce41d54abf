#pragma once

// What DataParallel and DistributedDataParallel share as modules: the wrapped
// module registered as the child "module" (so parameters(), zero_grad(),
// train() and to() reach it), saved and loaded as if bare, and a holder whose
// operator() sees a template forward().

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace lockstep {
namespace detail {

/// The size in dim 0 of the first tensor among `args`, -1 if none.
inline int64_t leading_batch_size() {
  return -1;
}
template <typename First, typename... Rest>
int64_t leading_batch_size(const First& first, const Rest&... rest) {
  if constexpr (std::is_same_v<std::decay_t<First>, torch::Tensor>) {
    return first.defined() && first.dim() > 0 ? first.size(0) : -1;
  } else {
    return leading_batch_size(rest...);
  }
}

/// What any WrapperModule is, whatever M: lockstep::save_safetensors and
/// load_safetensors reach the wrapped module through it.
struct ReplicaWrapperMark {
  virtual ~ReplicaWrapperMark() = default;
  virtual torch::nn::Module& wrapped_module() const = 0;
  /// Whether save_safetensors writes the wrapped module's files in this
  /// process: a DistributedDataParallel's are the same on every rank, and
  /// rank 0 alone writes them.
  virtual bool writes_files() const {
    return true;
  }
};

template <typename M>
class WrapperModule : public torch::nn::Module, public ReplicaWrapperMark {
 public:
  WrapperModule(M module, const char* who) : module_(std::move(module)) {
    TORCH_CHECK(!module_.is_empty(), who, ": the module to wrap is empty (a null holder).");
    register_module("module", module_.ptr());
  }

  /// The wrapped module.
  M module() const {
    return module_;
  }
  torch::nn::Module& wrapped_module() const override {
    return *module_.ptr();
  }

  /// Saves the wrapped module as if it were bare: no "module." prefix, so the
  /// file loads into a bare M, and a bare M's file loads here.
  void save(torch::serialize::OutputArchive& archive) const override {
    module_->save(archive);
  }
  void load(torch::serialize::InputArchive& archive) override {
    module_->load(archive);
  }

 protected:
  M module_;
};

/// A ModuleHolder whose operator() forwards to a template forward():
/// ModuleHolder's own cannot see one and would return void.
template <typename Impl>
class ForwardingHolder : public torch::nn::ModuleHolder<Impl> {
 public:
  using torch::nn::ModuleHolder<Impl>::ModuleHolder;

  template <typename... Args>
  auto operator()(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...)) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

} // namespace detail
} // namespace lockstep
