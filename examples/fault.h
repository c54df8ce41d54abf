#pragma once

// lockstep-train's fault injection, for tests and demos: LOCKSTEP_FAULT
// stops one rank at one step.

#include <c10/util/Exception.h>

#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace lockstep {
namespace examples {

// LOCKSTEP_FAULT=RANK:STEP[:CODE]: see --help.
inline void maybe_inject_fault(int rank, int64_t step) {
  static const char* spec = std::getenv("LOCKSTEP_FAULT");
  if (spec == nullptr) {
    return;
  }
  // The first attempt only, under lockstep-run or torchrun.
  for (const char* name : {"LOCKSTEP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    const char* restarts = std::getenv(name);
    if (restarts != nullptr && std::atoi(restarts) != 0) {
      return;
    }
  }
  int fault_rank = -1;
  long long fault_step = -1;
  char code[16] = "3";
  const int fields = std::sscanf(spec, "%d:%lld:%15s", &fault_rank, &fault_step, code);
  TORCH_CHECK(fields >= 2, "lockstep-train: LOCKSTEP_FAULT=\"", spec, "\" is malformed; expected RANK:STEP[:CODE], e.g. 1:30 or 1:30:kill.");
  if (fault_rank != rank || fault_step != step) {
    return;
  }
  std::fprintf(stderr, "lockstep-train: LOCKSTEP_FAULT: rank %d stops at step %lld (%s)\n", rank, fault_step,
               std::strcmp(code, "kill") == 0 ? "SIGKILL" : code);
  std::fflush(stderr);
  if (std::strcmp(code, "kill") == 0) {
    std::raise(SIGKILL);
  }
  if (std::strcmp(code, "hang") == 0) {
    // A stalled rank: deaf to SIGTERM, only SIGKILL ends it.
    std::signal(SIGTERM, SIG_IGN);
    while (true) {
      ::pause();
    }
  }
  std::_Exit(std::atoi(code));
}

} // namespace examples
} // namespace lockstep
