#pragma once

// An environment variable set for a scope: a failed expectation or an
// exception in between leaves the process's environment as it found it.

#include <cstdlib>
#include <optional>
#include <string>

namespace lockstep {
namespace testing {

/// Sets `name` to `value` (or unsets it, for nullptr) while alive, and puts
/// back what it was. Make it before any thread that reads the environment.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* before = std::getenv(name)) {
      before_ = before;
    }
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (before_) {
      ::setenv(name_.c_str(), before_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> before_;
};

} // namespace testing
} // namespace lockstep
