#pragma once

// Internal: the key that keeps tensors of different dtypes or devices apart
// when they are packed together into buckets (DDP's, FSDP's, and the
// broadcast of module state).

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace lockstep {
namespace detail {

/// "dtype@device", as "Float@cuda:0".
inline std::string bucket_key(c10::ScalarType dtype, const c10::Device& device) {
  return std::string(c10::toString(dtype)) + "@" + device.str();
}

} // namespace detail
} // namespace lockstep
