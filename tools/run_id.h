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

// Note [The rendezvous's id]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An elastic job's launchers meet in one store under one id (Note [One
// store, one job] in tools/kv_store.h). torchrun's default id is "none",
// the same for every job: two jobs started without --rdzv-id at one
// endpoint (one machine's default port) would merge into one, each node
// running its own program as ranks of the other's. The id here is --rdzv-id; else,
// under Slurm, the job and step, which every node of an srun step shares
// and two steps do not (a second srun at the endpoint is refused, told the
// first one's id); else none. Nodes with no id at all are told apart by
// their programs (Note [The job's first node sets its terms] in
// tools/job_record.h): a node whose PROGRAM and ARGS differ from the
// first node's is of another job, and refused. A start time, LOCKSTEP_RUN_ID's
// default, is not used: each node has its own.

/// The rendezvous's id; empty when the job has none. See Note [The
/// rendezvous's id].
inline std::string rendezvous_id(const std::string& rdzv_id, const GetEnv& get) {
  if (!rdzv_id.empty()) {
    return rdzv_id;
  }
  const char* job = get("SLURM_JOB_ID");
  if (job == nullptr || *job == '\0') {
    return "";
  }
  const char* step = get("SLURM_STEP_ID");
  return "slurm-" + std::string(job) + (step != nullptr && *step != '\0' ? "." + std::string(step) : "");
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
