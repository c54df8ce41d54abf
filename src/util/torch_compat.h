#pragma once

// Internal: the LibTorch API differences between the oldest supported release
// (Debian 12's 1.13) and PyTorch 2.x, in one place. Build-level differences
// (where LibTorch comes from, its OpenMP) are in cmake/LockstepTorch.cmake.
// Where a difference shows in a type, it is detected from that type; only what
// a type cannot tell is decided by the version number.

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/types.h>
#include <torch/version.h>

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

/// How autograd holds a node: std::shared_ptr in 1.x, c10::intrusive_ptr in 2.x.
using NodePtr = decltype(torch::autograd::Edge::function);

/// Points `variable`'s gradient accumulator at `node` again: set_data with
/// another dtype drops it. Autograd holds it weakly: a std::weak_ptr in 1.x,
/// a c10::weak_intrusive_ptr in 2.x.
inline void restore_grad_accumulator(const torch::Tensor& variable, const NodePtr& node) {
  using WeakNodePtr = decltype(torch::autograd::AutogradMeta::grad_accumulator_);
  torch::autograd::impl::set_grad_accumulator(variable, WeakNodePtr(node));
}

/// Makes an autograd node of type T, held the way this LibTorch holds nodes.
template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

/// The key of a parameter in Optimizer::state(): its TensorImpl's address,
/// as a pointer in 2.x and as that pointer's text in 1.13.
template <typename StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, const torch::Tensor& param) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream text; // c10::guts::to_string's spelling of a pointer
    text << static_cast<const void*>(param.unsafeGetTensorImpl());
    return text.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

/// Whether TCPStoreOptions can take a socket the caller bound and listens on
/// (masterListenFd, 2.x): then the store listens on one address. 1.13's
/// listens on every interface.
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 204
constexpr bool kStoreTakesListenSocket = true;
inline void set_listen_socket(c10d::TCPStoreOptions& options, int fd) {
  options.masterListenFd = fd;
}
#else
constexpr bool kStoreTakesListenSocket = false;
inline void set_listen_socket(c10d::TCPStoreOptions&, int) {}
#endif

/// Whether c10d's Gloo process group carries BFloat16 and Bool tensors: its
/// type switch gained both in PyTorch 2.2 (pytorch/pytorch#113557); 1.13's
/// refuses them inside the collective ("Invalid scalar type"). Tested: 1.13
/// (no) and 2.15 (yes); the releases between follow the version number.
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 202
constexpr bool kGlooCarriesBFloat16AndBool = true;
#else
constexpr bool kGlooCarriesBFloat16AndBool = false;
#endif

/// A c10d TCPStore. PyTorch 2.x serves it from its libuv backend by default;
/// a LibTorch built without libuv (Debian 13's, for one) refuses that, so the
/// classic backend is taken instead. Both speak the same protocol, so ranks
/// whose LibTorch differ here still meet.
inline c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, c10d::TCPStoreOptions options) {
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 204 // libuv became the default in 2.4
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    const std::string message = e.what();
    if (!options.useLibUV || message.find("ibuv") == std::string::npos) {
      throw;
    }
  }
  options.useLibUV = false;
#endif
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

/// Autocast's state for one device type. PyTorch 2.4 made it one API that
/// takes the device type (at::autocast::is_autocast_enabled(type), ...);
/// before it, each device type had its own functions, CUDA's named for "the"
/// GPU. Lockstep's guard speaks the first and maps it onto the second, for
/// the device types both know: CPU and CUDA.
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 204
inline bool autocast_enabled(c10::DeviceType type) {
  return at::autocast::is_autocast_enabled(type);
}
inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
  at::autocast::set_autocast_enabled(type, enabled);
}
inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
  return at::autocast::get_autocast_dtype(type);
}
inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
  at::autocast::set_autocast_dtype(type, dtype);
}
/// CPU autocast to float16, which 1.13 refuses (its Python guard says "CPU
/// Autocast only supports dtype of torch.bfloat16").
constexpr bool kCpuAutocastTakesHalf = true;
#else
inline bool autocast_enabled(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
}
inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}
constexpr bool kCpuAutocastTakesHalf = false;
#endif

/// The safetensors dtypes that only some LibTorch releases have, by their
/// safetensors names (the Python package's table, safetensors/torch.py):
/// float8 came in 2.1 (its fnuz variants in 2.2), the unsigned integers
/// wider than a byte in 2.3, float8_e8m0fnu (microscaling's scales) in 2.7.
inline std::vector<std::pair<std::string, c10::ScalarType>> versioned_safetensors_dtypes() {
  std::vector<std::pair<std::string, c10::ScalarType>> dtypes;
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 201
  dtypes.emplace_back("F8_E4M3", c10::ScalarType::Float8_e4m3fn);
  dtypes.emplace_back("F8_E5M2", c10::ScalarType::Float8_e5m2);
#endif
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 202
  dtypes.emplace_back("F8_E4M3FNUZ", c10::ScalarType::Float8_e4m3fnuz);
  dtypes.emplace_back("F8_E5M2FNUZ", c10::ScalarType::Float8_e5m2fnuz);
#endif
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 203
  dtypes.emplace_back("U16", c10::ScalarType::UInt16);
  dtypes.emplace_back("U32", c10::ScalarType::UInt32);
  dtypes.emplace_back("U64", c10::ScalarType::UInt64);
#endif
#if TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 207
  dtypes.emplace_back("F8_E8M0", c10::ScalarType::Float8_e8m0fnu);
#endif
  return dtypes;
}

/// The base of a CPU allocator, which defines allocate_block. Allocator's
/// allocate is const in 1.13 and not in 2.x, where it also asks for copy_data;
/// the type tells which.
template <typename Base, bool kConstAllocate = std::is_same_v<decltype(&Base::allocate), c10::DataPtr (Base::*)(size_t) const>>
class AllocatorBase;

template <typename Base>
class AllocatorBase<Base, true> : public Base {
 public:
  c10::DataPtr allocate(size_t n) const override {
    return allocate_block(n);
  }

 protected:
  virtual c10::DataPtr allocate_block(size_t n) const = 0;
};

template <typename Base>
class AllocatorBase<Base, false> : public Base {
 public:
  c10::DataPtr allocate(size_t n) override {
    return allocate_block(n);
  }
  void copy_data(void* dest, const void* src, size_t count) const override {
    this->default_copy_data(dest, src, count);
  }

 protected:
  virtual c10::DataPtr allocate_block(size_t n) const = 0;
};

using CpuAllocatorBase = AllocatorBase<c10::Allocator>;

/// Hands the text of each warning raised on this thread to on_warning while
/// a WarningsTo guard holds it, TORCH_WARN_ONCE's every time. The handler's
/// namespace and process() differ: c10::Warning and (location, text, verbatim)
/// in 1.13, c10::WarningUtils and a c10::Warning from 2.0 on.
class WarningTextHandler : public c10::WarningHandler {
 public:
  virtual void on_warning(const std::string& text) = 0;
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override {
    on_warning(warning.msg());
  }
#else
  void process(const c10::SourceLocation&, const std::string& text, const bool) override {
    on_warning(text);
  }
#endif
};

#if TORCH_VERSION_MAJOR >= 2
namespace warning_utils = c10::WarningUtils;
#else
namespace warning_utils = c10::Warning;
#endif

/// Routes this thread's warnings to a handler, each one every time, while it lives.
class WarningsTo {
 public:
  explicit WarningsTo(WarningTextHandler& handler) : handler_(&handler), always_(true) {}

 private:
  warning_utils::WarningHandlerGuard handler_;
  warning_utils::WarnAlways always_;
};

} // namespace detail
} // namespace lockstep
