#pragma once

// CLI11 checks whose refusals say what is wrong in words. CLI11 2.1's
// PositiveNumber and NonNegativeNumber refuse 0 with "Value 0 not in range
// 0.000000 to 17976931348623157...", a 309-digit bound, and an unsigned
// option takes "-1" as 2^64-1 without a word. These also refuse infinity and
// NaN (a learning rate of infinity trains to NaN). Shared by lockstep-run and
// lockstep-train, included as <tools/cli_checks.h>.

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

namespace lockstep {
namespace tools {

namespace detail {
inline CLI::Validator number_check(bool allow_zero) {
  const std::string bound = allow_zero ? "0 or more" : "greater than 0";
  return CLI::Validator(
      [allow_zero, bound](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long double value = std::strtold(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(value)) {
          return "expected a number " + bound + ", got '" + text + "'";
        }
        if (value < 0 || (!allow_zero && value == 0)) {
          return "must be " + bound + ", got " + text;
        }
        return std::string();
      },
      allow_zero ? "NONNEGATIVE" : "POSITIVE");
}
} // namespace detail

/// A number greater than 0.
inline CLI::Validator positive() {
  return detail::number_check(false);
}

/// A number, 0 or more (an unsigned option's "-1" included).
inline CLI::Validator non_negative() {
  return detail::number_check(true);
}

} // namespace tools
} // namespace lockstep
