#pragma once

// Checks shared by the scenarios of lockstep_ddp_worker (tests/ddp_worker.cpp
// and the files beside it): a failed check prints "CHECK FAILED" and counts,
// so that every check of a scenario runs and the process exits 1 at the end.

#include <lockstep/process_group.h>

#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

inline int failures = 0;

inline void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::printf("rank %d: CHECK FAILED: %s\n", rank, what.c_str());
    ++failures;
  }
}

// Expects `body` to throw a c10::Error on this rank whose message holds every
// one of `needles`.
template <typename F>
void expect_error(const ProcessGroup& group, F body, const std::vector<std::string>& needles) {
  try {
    body();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& needle : needles) {
      check(message.find(needle) != std::string::npos, "the error names '" + needle + "': " + message, group.rank());
    }
    return;
  }
  check(false, "an error was expected", group.rank());
}

// Scenarios in tests/ddp_worker_answers.cpp: what wrapping in DDP must not
// change (issue "Wrapping must never change the answer").
void shared_parameters(const ProcessGroup& group);
void unused_across_no_sync(const ProcessGroup& group, bool views);
void wrapped_twice(const ProcessGroup& group);
void options_differ(const ProcessGroup& group);

} // namespace testing
} // namespace lockstep
