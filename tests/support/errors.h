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

/// Expects `statement` to throw a c10::Error whose message holds each of the
/// string literals that follow.
#define EXPECT_ERROR_SAYS(statement, ...)                                                              \
  do {                                                                                                 \
    const std::string lockstep_message_ = ::lockstep::testing::error_of([&] { (void)(statement); });   \
    for (const char* lockstep_needle_ : {__VA_ARGS__}) {                                               \
      EXPECT_NE(lockstep_message_.find(lockstep_needle_), std::string::npos)                           \
          << "expected \"" << lockstep_needle_ << "\" in: "                                            \
          << (lockstep_message_.empty() ? std::string("(no error)") : lockstep_message_);              \
    }                                                                                                  \
  } while (0)
