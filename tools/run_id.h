#pragma once

// The job's id, which every attempt of it shares: lockstep-train's default
// output folder is runs/ID, where a restart finds its checkpoint.

#include <functional>
#include <string>

namespace lockstep {
namespace tools {

using GetEnv = std::function<const char*(const char*)>;

/// The job's id, the same for every attempt of it (lockstep-train's default
/// output folder is runs/ID, where a restart finds its checkpoint):
/// --rdzv-id, which torchrun's users give every node (an elastic job takes
/// it too); else LOCKSTEP_RUN_ID; else Slurm's job and step (a requeued job keeps both, two sruns of one
/// allocation differ; the trainer's own id does the same); else the launch
/// time `now`, and on one node this launcher's `pid` too, so that two jobs
/// started in the same second never share a folder (nodes of a static job
/// with none of these have no id in common: lockstep-run warns).
inline std::string default_run_id(const GetEnv& get, const std::string& now, long pid, int nnodes,
                                  const std::string& rdzv_id = "") {
  const auto set = [&](const char* name) {
    const char* v = get(name);
    return v != nullptr && *v != '\0' ? std::string(v) : std::string();
  };
  if (!rdzv_id.empty()) {
    return rdzv_id;
  }
  if (!set("LOCKSTEP_RUN_ID").empty()) {
    return set("LOCKSTEP_RUN_ID");
  }
  if (!set("SLURM_JOB_ID").empty()) {
    return "slurm-" + set("SLURM_JOB_ID") + (set("SLURM_STEP_ID").empty() ? "" : "." + set("SLURM_STEP_ID"));
  }
  return nnodes == 1 ? now + "-" + std::to_string(pid) : now;
}

/// Whether default_run_id's id is one every node of the job has (from
/// --rdzv-id, LOCKSTEP_RUN_ID or Slurm), not one made of a start time.
inline bool run_id_shared(const GetEnv& get, const std::string& rdzv_id) {
  const auto set = [&](const char* name) {
    const char* v = get(name);
    return v != nullptr && *v != '\0';
  };
  return !rdzv_id.empty() || set("LOCKSTEP_RUN_ID") || set("SLURM_JOB_ID");
}

} // namespace tools
} // namespace lockstep
