#pragma once

// CLI11 checks whose refusals say what is wrong in words. CLI11 2.1's
// PositiveNumber and NonNegativeNumber refuse 0 with "Value 0 not in range
// 0.000000 to 17976931348623157...", a 309-digit bound, and an unsigned
// option takes "-1" as 2^64-1 without a word. These also refuse infinity and
// NaN (a learning rate of infinity trains to NaN), and whole numbers beyond
// an option's bounds, which CLI11 would clamp to its type's limit without a
// word (--batch-size 18446744073709551617 became 2^63-1). Shared by
// lockstep-run and lockstep-train, included as <common/cli_checks.h>.

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

namespace lockstep {
namespace common {

/// The exit code of both tools when they refuse a command line, before
/// anything runs: "TOOL: what is wrong" and "Run 'TOOL --help' for usage.".
constexpr int kUsageError = 2;

namespace detail {
/// `text` as a finite number, whole text and in range of long double; false
/// (and `value` unset) otherwise.
inline bool parse_finite(const std::string& text, long double& value) {
  char* end = nullptr;
  errno = 0;
  const long double parsed = std::strtold(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(parsed)) {
    return false;
  }
  value = parsed;
  return true;
}

inline CLI::Validator number_check(bool allow_zero) {
  const std::string bound = allow_zero ? "0 or more" : "greater than 0";
  return CLI::Validator(
      [allow_zero, bound](std::string& text) -> std::string {
        long double value = 0;
        if (!parse_finite(text, value)) {
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

/// A whole number from `min` to `max`, in decimal digits.
inline CLI::Validator whole_number(long long min, unsigned long long max) {
  const std::string range = "a whole number from " + std::to_string(min) + " to " + std::to_string(max);
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        const bool negative = !text.empty() && text[0] == '-';
        const size_t digits = text.find_first_not_of("0123456789", negative ? 1 : 0);
        bool fits = digits == std::string::npos && text.size() > (negative ? 1u : 0u);
        if (fits) {
          errno = 0;
          if (negative) {
            const long long value = std::strtoll(text.c_str(), nullptr, 10);
            fits = errno != ERANGE && value >= min;
          } else {
            const unsigned long long value = std::strtoull(text.c_str(), nullptr, 10);
            fits = errno != ERANGE && value <= max && (min <= 0 || value >= static_cast<unsigned long long>(min));
          }
        }
        return fits ? std::string() : "must be " + range + ", got " + text;
      },
      "");
}

/// A number from `min` to `max`. CLI::Range lets NaN through, since every
/// comparison with it is false: --gamma nan trained to NaN.
inline CLI::Validator number_in(double min, double max) {
  std::ostringstream bounds;
  bounds << min << " to " << max;
  const std::string range = bounds.str();
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        long double value = 0;
        const bool number = detail::parse_finite(text, value);
        return number && value >= min && value <= max ? std::string()
                                                       : "must be a number from " + range + ", got " + text;
      },
      "FLOAT in [" + range + "]");
}

/// A number greater than 0.
inline CLI::Validator positive() {
  return detail::number_check(false);
}

/// A number, 0 or more (an unsigned option's "-1" included).
inline CLI::Validator non_negative() {
  return detail::number_check(true);
}

} // namespace common
} // namespace lockstep
