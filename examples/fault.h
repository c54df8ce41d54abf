#pragma once

// lockstep-train's fault injection, for tests and demos: LOCKSTEP_FAULT
// stops one rank at one step.

#include <c10/util/Exception.h>

#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace lockstep {
namespace examples {

/// What LOCKSTEP_FAULT=RANK:STEP[:CODE] asks for.
struct Fault {
  int64_t rank = -1;
  int64_t step = -1;
  std::string action = "exit"; // exit, kill (SIGKILL) or hang (deaf to SIGTERM)
  int exit_code = 3;
};

/// Parses LOCKSTEP_FAULT's value: RANK and STEP whole numbers from 0, CODE
/// an exit code from 1 to 255, `kill` or `hang`; anything else is an error
/// that says the form. A fault that could exit with 0, or with another code
/// than the one given, would look like something else.
inline Fault parse_fault(const std::string& spec) {
  const auto refuse = [&spec](const std::string& why) {
    TORCH_CHECK(false, "lockstep-train: LOCKSTEP_FAULT=\"", spec, "\" is malformed: ", why,
                ". Expected RANK:STEP[:CODE], e.g. 1:30, 1:30:kill or 1:30:hang, with CODE an exit code from 1 to 255.");
  };
  std::vector<std::string> fields;
  for (size_t start = 0;;) {
    const size_t colon = spec.find(':', start);
    fields.push_back(spec.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) {
      break;
    }
    start = colon + 1;
  }
  if (fields.size() < 2 || fields.size() > 3) {
    refuse("it has " + std::to_string(fields.size()) + " field(s)");
  }
  const auto number = [&](const std::string& text, const char* name, int64_t low, int64_t high) {
    char* end = nullptr;
    errno = 0;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0 || value < low || value > high) {
      refuse(std::string(name) + " \"" + text + "\" is not a whole number from " + std::to_string(low) + " to " +
             std::to_string(high));
    }
    return static_cast<int64_t>(value);
  };
  Fault fault;
  fault.rank = number(fields[0], "RANK", 0, 1 << 20);
  fault.step = number(fields[1], "STEP", 0, INT64_MAX);
  if (fields.size() == 3) {
    if (fields[2] == "kill" || fields[2] == "hang") {
      fault.action = fields[2];
    } else {
      fault.exit_code = static_cast<int>(number(fields[2], "CODE", 1, 255));
    }
  }
  return fault;
}

// LOCKSTEP_FAULT=RANK:STEP[:CODE]: see --help.
inline void maybe_inject_fault(int rank, int64_t step) {
  static const char* spec = std::getenv("LOCKSTEP_FAULT");
  if (spec == nullptr) {
    return;
  }
  static const Fault fault = parse_fault(spec); // refused at the first step, on every rank
  // The first attempt only, under lockstep-run or torchrun.
  for (const char* name : {"LOCKSTEP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    const char* restarts = std::getenv(name);
    if (restarts != nullptr && std::atoi(restarts) != 0) {
      return;
    }
  }
  if (fault.rank != rank || fault.step != step) {
    return;
  }
  std::fprintf(stderr, "lockstep-train: LOCKSTEP_FAULT: rank %d stops at step %lld (%s)\n", rank,
               static_cast<long long>(fault.step),
               fault.action == "exit" ? std::to_string(fault.exit_code).c_str()
                                      : (fault.action == "kill" ? "SIGKILL" : "hang"));
  std::fflush(stderr);
  if (fault.action == "kill") {
    std::raise(SIGKILL);
  }
  if (fault.action == "hang") {
    // A stalled rank: deaf to SIGTERM, only SIGKILL ends it.
    std::signal(SIGTERM, SIG_IGN);
    while (true) {
      ::pause();
    }
  }
  std::_Exit(fault.exit_code);
}

} // namespace examples
} // namespace lockstep
