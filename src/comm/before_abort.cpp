// Hooks run before a backend ends the process (src/comm/before_abort.h).

#include "comm/before_abort.h"

#include <mutex>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

namespace {

std::mutex& hooks_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<std::function<void(const std::string&)>>& hooks() {
  static std::vector<std::function<void(const std::string&)>> all;
  return all;
}

} // namespace

void on_before_abort(std::function<void(const std::string&)> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex());
  hooks().push_back(std::move(hook));
}

void before_abort(const std::string& reason) noexcept {
  std::vector<std::function<void(const std::string&)>> all;
  {
    std::lock_guard<std::mutex> lock(hooks_mutex());
    all = hooks();
  }
  for (const auto& hook : all) {
    try {
      hook(reason);
    } catch (...) {
    }
  }
}

} // namespace detail
} // namespace lockstep
