#pragma once

// The id that every attempt of one job shares, which names lockstep-train's
// default output folder (runs/<id>), so that a restarted job finds its
// checkpoint there.

#include <unistd.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <string>

namespace lockstep {
namespace examples {

// The parent process as "<pid>-<start time>" (the start time because pids
// come round again), or "" where /proc does not say.
inline std::string parent_process_id() {
  const std::string pid = std::to_string(::getppid());
  std::ifstream file("/proc/" + pid + "/stat");
  std::string stat((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')'); // the command name may hold spaces and parentheses
  if (close == std::string::npos) {
    return "";
  }
  std::istringstream fields(stat.substr(close + 2)); // from field 3, the state
  std::string field;
  for (int k = 3; k <= 22 && fields >> field; ++k) {
    if (k == 22) { // starttime, in clock ticks after boot
      return pid + "-" + field;
    }
  }
  return "";
}

// `get` looks a variable up (nullptr: unset); `agent` is the parent
// process's id (parent_process_id). In order: lockstep-run's run id,
// torchrun's (--rdzv-id; "none" when not given), Slurm's job and step (a
// requeued job keeps both; two sruns of one allocation differ), and under
// torchrun without an id the agent that restarts the workers, which every
// attempt of the job on this node shares. "" when nothing names the job.
inline std::string job_id(const std::function<const char*(const char*)>& get, const std::string& agent) {
  auto set = [&](const char* name) {
    const char* v = get(name);
    return v != nullptr && *v != '\0' && std::string(v) != "none" ? std::string(v) : std::string();
  };
  for (const char* name : {"LOCKSTEP_RUN_ID", "TORCHELASTIC_RUN_ID"}) {
    if (!set(name).empty()) {
      return set(name);
    }
  }
  if (!set("SLURM_JOB_ID").empty()) {
    return "slurm-" + set("SLURM_JOB_ID") + (set("SLURM_STEP_ID").empty() ? "" : "." + set("SLURM_STEP_ID"));
  }
  if (get("TORCHELASTIC_RESTART_COUNT") != nullptr && !agent.empty()) {
    return "torchrun-" + agent;
  }
  return "";
}

} // namespace examples
} // namespace lockstep
