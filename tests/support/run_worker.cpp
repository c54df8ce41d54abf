#include "run_worker.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>

namespace lockstep {
namespace testing {

void report_failure(int rank, const std::string& what) {
  std::printf("rank %d: CHECK FAILED: %s\n", rank, what.c_str());
  ++worker_failures;
}

namespace {

// "a|b|c DIR|d", the table's scenarios with the argument each needs.
std::string scenario_names(const WorkerTable& table) {
  std::string names;
  for (const auto& [name, scenario] : table) {
    names += (names.empty() ? "" : "|") + name + (scenario.argument.empty() ? "" : " " + scenario.argument);
  }
  return names;
}

const WorkerScenario* find_scenario(const WorkerTable& table, const std::string& name) {
  for (const auto& [known, scenario] : table) {
    if (known == name) {
      return &scenario;
    }
  }
  return nullptr;
}

// gloo under lockstep-run's variables; LOCKSTEP_TEST_BACKEND=mpi under mpirun.
ProcessGroup group_for(const WorkerScenario& scenario) {
  const char* chosen = std::getenv("LOCKSTEP_TEST_BACKEND");
  const std::string backend = chosen != nullptr ? chosen : "gloo";
  if (scenario.make_group) {
    return scenario.make_group(backend);
  }
  auto options = ProcessGroupOptions().backend(backend);
  if (scenario.timeout.count() > 0) {
    options.timeout(scenario.timeout);
  }
  return init_process_group(options);
}

} // namespace

int run_worker(int argc, char** argv, const WorkerTable& table) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s %s [ARGUMENT]\n", argv[0], scenario_names(table).c_str());
    return 2;
  }
  const WorkerScenario* scenario = find_scenario(table, argv[1]);
  if (scenario == nullptr) {
    std::fprintf(stderr, "unknown scenario %s; the known ones: %s\n", argv[1], scenario_names(table).c_str());
    return 2;
  }
  if (!scenario->argument.empty() && argc != 3) {
    std::fprintf(stderr, "scenario %s needs %s\n", argv[1], scenario->argument.c_str());
    return 2;
  }
  const std::string argument = argc == 3 ? argv[2] : "";
  int rank = -1;
  try {
    auto group = group_for(*scenario);
    rank = group.rank();
    const Check check = [&rank](bool ok, const std::string& what) {
      if (!ok) {
        report_failure(rank, what);
      }
    };
    WorkerContext context{group, check, argument};
    scenario->run(context);
  } catch (const c10::Error& e) {
    std::printf("rank %d: ERROR: %s\n", rank, e.what_without_backtrace());
    std::fflush(stdout);
    return 3;
  }
  if (worker_failures == 0) {
    std::printf("rank %d: OK\n", rank);
  }
  std::fflush(stdout);
  return worker_failures == 0 ? 0 : 1;
}

} // namespace testing
} // namespace lockstep
