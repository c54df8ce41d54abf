#pragma once

// The warnings (TORCH_WARN) a piece of code raises on this thread.

#include "../../src/util/torch_compat.h"

#include <functional>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

/// The texts of the warnings raised on this thread while `fn` runs, in order.
inline std::vector<std::string> warnings_of(const std::function<void()>& fn) {
  struct : detail::WarningTextHandler {
    std::vector<std::string> texts;
    void on_warning(const std::string& text) override {
      texts.push_back(text);
    }
  } warnings;
  detail::WarningsTo to(warnings);
  fn();
  return warnings.texts;
}

/// The same, joined by newlines: "" when there was none.
inline std::string warning_text_of(const std::function<void()>& fn) {
  std::string joined;
  for (const auto& text : warnings_of(fn)) {
    joined += (joined.empty() ? "" : "\n") + text;
  }
  return joined;
}

} // namespace testing
} // namespace lockstep
