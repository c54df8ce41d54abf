#pragma once

// The main of a worker program (lockstep_ddp_worker, lockstep_fsdp_worker,
// lockstep_collectives_worker): one rank of a multi-process test, which
// reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
// or mpirun's with LOCKSTEP_TEST_BACKEND=mpi, and runs the scenario argv[1]
// names from a table:
//
//   WORKER SCENARIO [ARGUMENT]
//
// Prints "rank R: OK" and exits 0 when every check passed, "rank R: CHECK
// FAILED: ..." for each failed one and exits 1, "rank R: ERROR: ..." and
// exits 3 on an unexpected lockstep error, exits 2 on a wrong command line
// (an unknown scenario names the known ones).

#include <lockstep/lockstep.h>

#include "collective_contract.h"

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace testing {

/// Failed checks so far in this worker process; run_worker exits 1 if any.
inline int worker_failures = 0;

/// Prints a failed check as "rank R: CHECK FAILED: what" and counts it.
void report_failure(int rank, const std::string& what);

/// What a scenario runs with: the group, the check that reports into
/// worker_failures, and the command line's second argument ("" if none).
struct WorkerContext {
  ProcessGroup& group;
  const Check& check;
  const std::string& argument;
};

struct WorkerScenario {
  std::function<void(WorkerContext&)> run;
  /// Non-empty: the scenario needs the second argument, and the usage line
  /// names it so (e.g. "DIR"). Empty: a second argument is optional and only
  /// tags the processes (a test's pgrep looks for it).
  std::string argument = "";
  /// Non-zero: the group's timeout, for scenarios that wait for one to end.
  std::chrono::milliseconds timeout{0};
  /// Set: makes the group from the backend's name instead of
  /// init_process_group.
  std::function<ProcessGroup(const std::string& backend)> make_group = nullptr;
};

/// Scenario names and what they run, in the order the usage line lists them.
using WorkerTable = std::vector<std::pair<std::string, WorkerScenario>>;

/// Runs the scenario argv[1] names from `table` on this rank; returns the
/// process's exit status.
int run_worker(int argc, char** argv, const WorkerTable& table);

} // namespace testing
} // namespace lockstep
