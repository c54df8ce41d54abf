#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace lockstep {
namespace testing {

/// The message of the c10::Error that fn throws, or "" if it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

} // namespace testing
} // namespace lockstep
