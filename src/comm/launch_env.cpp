#include "comm/launch_env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace lockstep {
namespace detail {

int64_t parse_int(const std::string& name, const char* value, int64_t low, int64_t high, const char* form) {
  TORCH_CHECK(value != nullptr, "lockstep: environment variable ", name, " is not set; expected ", form,
              ". Launch with lockstep-run or torchrun, or pass the value in ProcessGroupOptions.");
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(
      *value != '\0' && *end == '\0' && errno == 0 && parsed >= low && parsed <= high, "lockstep: environment variable ",
      name, "=\"", value, "\" is malformed; expected ", form, ".");
  return parsed;
}

namespace {

// Note [MPI launchers]
// ~~~~~~~~~~~~~~~~~~~~
// mpirun, srun and MPICH's launcher start every rank themselves and tell each
// process where it stands in variables of their own. When torchrun's RANK and
// WORLD_SIZE are absent, these are read instead, and the job is an MPI job:
// "auto" then picks the mpi backend for CPU tensors, and no store is needed.
//
// A Slurm batch script also has SLURM_PROCID and SLURM_NTASKS (the whole
// allocation's), but it is one process, not a task of a step: a program
// started there directly, not by srun, would wait for ranks that never come.
// So Slurm's variables count only inside a step (SLURM_STEP_ID).
struct MpiLauncher {
  const char* name;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size; // may be unset even under this launcher
  const char* inside;     // set only in the launcher's processes; nullptr: rank and size suffice
};
constexpr MpiLauncher kMpiLaunchers[] = {
    {"Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},
    {"Slurm's srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID"},
    {"MPICH's mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", nullptr},
};

// The launcher whose rank and size variables are both set, or nullptr.
const MpiLauncher* mpi_launcher_of(const std::function<const char*(const char*)>& get) {
  for (const auto& l : kMpiLaunchers) {
    if (get(l.size) != nullptr && get(l.rank) != nullptr && (l.inside == nullptr || get(l.inside) != nullptr)) {
      return &l;
    }
  }
  return nullptr;
}

// Rank, size and local rank from an MPI launcher's variables; false if none set them.
bool read_mpi_launcher(LaunchEnv& env, const std::function<const char*(const char*)>& get) {
  const MpiLauncher* l = mpi_launcher_of(get);
  if (l == nullptr) {
    return false;
  }
  env.world_size = parse_int(l->size, get(l->size), 1, 1 << 20, "a whole number >= 1");
  env.rank = parse_int(l->rank, get(l->rank), 0, env.world_size - 1, "a whole number in [0, the world size)");
  env.local_world_size = get(l->local_size) != nullptr
      ? parse_int(l->local_size, get(l->local_size), 1, 1 << 20, "a whole number >= 1")
      : env.world_size;
  if (const char* v = get(l->local_rank)) {
    env.local_rank = parse_int(l->local_rank, v, 0, env.local_world_size - 1, "a whole number below the local size");
  }
  env.mpi_launcher = l->name;
  return true;
}

// Note [Stale RANK and WORLD_SIZE]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun's RANK and WORLD_SIZE win over an MPI launcher's variables, so
// that `srun torchrun ...`, `mpirun ... torchrun ...` and ranks started by
// hand in an interactive Slurm step work: each worker is a rank of the inner
// launch. But the same pair left in a shell (an `export RANK=0 WORLD_SIZE=1`
// from an earlier run) would make every process of `mpirun -np 4` rank 0 of
// 1: four jobs training alone, each writing the same checkpoint, with no
// error. A launch inside the launcher's tasks starts one worker or more per
// task: its world is at least as large as the launcher's, and, where it is as
// large, a launcher that keeps the tasks' order gives the same ranks. So
// under an MPI launcher a world smaller than its, or as large with another
// rank, is refused, unless a launcher that numbers ranks its own way set it:
// torchrun and lockstep-run give every worker TORCHELASTIC_RUN_ID. Values
// passed in ProcessGroupOptions are the caller's and stand.
void check_not_stale(const LaunchEnv& env, const ProcessGroupOptions& options, const MpiLauncher* mpi,
                     const std::function<const char*(const char*)>& get) {
  const bool rank_from_env = options.rank() < 0, size_from_env = options.world_size() <= 0;
  if (mpi == nullptr || !(rank_from_env || size_from_env) || get("TORCHELASTIC_RUN_ID") != nullptr) {
    return;
  }
  const int64_t size = parse_int(mpi->size, get(mpi->size), 1, 1 << 20, "a whole number >= 1");
  const int64_t rank = parse_int(mpi->rank, get(mpi->rank), 0, size - 1, "a whole number in [0, the world size)");
  const bool nested = env.world_size > size || (env.world_size == size && env.rank == rank);
  const std::string given = rank_from_env && size_from_env ? "RANK and WORLD_SIZE from the environment"
      : rank_from_env ? "RANK from the environment, the world size from ProcessGroupOptions"
                      : "the rank from ProcessGroupOptions, WORLD_SIZE from the environment";
  TORCH_CHECK(nested, "lockstep: rank ", env.rank, " of ", env.world_size, " (", given, ") cannot be a launch inside ",
              mpi->name, ", which started this process as rank ", rank, " of ", size, " (", mpi->rank, ", ", mpi->size,
              "): a launcher inside it gives a world at least as large, with the same ranks where it is as large, and "
              "TORCHELASTIC_RUN_ID, which torchrun and lockstep-run set, is unset. Variables left from another launch "
              "(an export in the shell) would make each process a job of its own. Unset RANK and WORLD_SIZE to take "
              "the launcher's; a launcher of your own that numbers ranks otherwise sets TORCHELASTIC_RUN_ID, as "
              "torchrun does.");
}

// Rank, size and local rank from `options`, else from torchrun's variables
// (WORLD_SIZE, RANK, LOCAL_WORLD_SIZE, LOCAL_RANK).
void read_torchrun_env(LaunchEnv& env, const ProcessGroupOptions& options,
                       const std::function<const char*(const char*)>& get) {
  // Under an MPI launcher, half of the pair given turns its variables off.
  const MpiLauncher* mpi = mpi_launcher_of(get);
  const bool rank_given = options.rank() >= 0 || get("RANK") != nullptr;
  const bool size_given = options.world_size() > 0 || get("WORLD_SIZE") != nullptr;
  TORCH_CHECK(mpi == nullptr || (rank_given && size_given), "lockstep: started by ", mpi->name, " (", mpi->rank, "=",
              get(mpi->rank), "), but only ", rank_given ? "the rank" : "the world size", " is given (by "
              "ProcessGroupOptions or ", rank_given ? "RANK" : "WORLD_SIZE", "), so the launcher's variables are "
              "not read and ", rank_given ? "the world size" : "the rank", " is unknown. Give both in "
              "ProcessGroupOptions, or neither (then ", mpi->rank, " and ", mpi->size, " are read).");
  env.world_size = options.world_size() > 0
      ? options.world_size()
      : parse_int("WORLD_SIZE", get("WORLD_SIZE"), 1, 1 << 20, "a whole number >= 1");
  if (options.rank() >= 0) {
    env.rank = options.rank();
  } else {
    env.rank = parse_int("RANK", get("RANK"), 0, 1 << 20, "a whole number in [0, WORLD_SIZE)");
    TORCH_CHECK(env.rank < env.world_size, "lockstep: environment variable RANK=", env.rank,
                " is out of range for WORLD_SIZE=", env.world_size, "; expected 0 <= RANK < WORLD_SIZE.");
  }
  check_not_stale(env, options, mpi, get);
  if (const char* v = get("LOCAL_WORLD_SIZE")) {
    env.local_world_size = parse_int("LOCAL_WORLD_SIZE", v, 1, 1 << 20, "a whole number >= 1");
  }
  if (const char* v = get("LOCAL_RANK")) {
    env.local_rank = parse_int("LOCAL_RANK", v, 0, 1 << 20, "a whole number in [0, LOCAL_WORLD_SIZE)");
    // Only against a LOCAL_WORLD_SIZE that was given: launchers that set
    // LOCAL_RANK alone (DeepSpeed's, hand-written scripts) are valid, as
    // PyTorch's init_process_group, which reads neither, takes them.
    TORCH_CHECK(get("LOCAL_WORLD_SIZE") == nullptr || env.local_rank < env.local_world_size,
                "lockstep: environment variable LOCAL_RANK=", env.local_rank, " is out of range for LOCAL_WORLD_SIZE=",
                env.local_world_size, "; expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE.");
  }
}

} // namespace

const char* find_mpi_launcher(const std::function<const char*(const char*)>& get) {
  const MpiLauncher* l = mpi_launcher_of(get);
  return l != nullptr ? l->name : nullptr;
}

int64_t local_rank_of(const std::function<const char*(const char*)>& get) {
  const bool torchrun = get("WORLD_SIZE") != nullptr || get("RANK") != nullptr; // as parse_launch_env decides
  const MpiLauncher* mpi = torchrun ? nullptr : mpi_launcher_of(get);
  const char* name = mpi != nullptr ? mpi->local_rank : "LOCAL_RANK";
  const char* value = get(name);
  return value != nullptr ? parse_int(name, value, 0, 1 << 20, "a whole number >= 0") : -1;
}

int64_t mpi_ranks_on_this_host(const std::function<const char*(const char*)>& get) {
  const MpiLauncher* l = mpi_launcher_of(get);
  if (l == nullptr) {
    return 0;
  }
  const char* value = get(l->local_size) != nullptr ? get(l->local_size) : get(l->size);
  char* end = nullptr;
  errno = 0;
  const long long ranks = std::strtoll(value, &end, 10);
  return end != value && *end == '\0' && errno == 0 && ranks > 0 ? ranks : 0;
}

void check_timeout(std::chrono::milliseconds timeout, const char* what) {
  TORCH_CHECK(timeout.count() > 0 && timeout <= kMaxTimeout, "lockstep: ", what, " is ", timeout.count(),
              " ms; expected a positive duration of at most 7 days (", kMaxTimeout.count(), " ms).");
}

// The options' own values, before any is replaced by the environment's: a
// value that is neither "unset" nor in range would be read as unset (a
// world_size of 0, a port of -1), or cut to an int (a world_size of 2^32 +
// 2 to 2).
void check_set_options(const ProcessGroupOptions& options) {
  TORCH_CHECK(options.world_size() == -1 || (options.world_size() >= 1 && options.world_size() <= (1 << 20)),
              "lockstep: ProcessGroupOptions::world_size is ", options.world_size(), "; expected 1 to ", 1 << 20,
              " processes, or -1 (the default) for $WORLD_SIZE.");
  TORCH_CHECK(options.rank() >= -1 && options.rank() < (1 << 20), "lockstep: ProcessGroupOptions::rank is ",
              options.rank(), "; expected 0 <= rank < world_size, or -1 (the default) for $RANK.");
  TORCH_CHECK(options.master_port() >= 0 && options.master_port() <= 65535, "lockstep: ProcessGroupOptions::"
              "master_port is ", options.master_port(), "; expected a port number from 1 to 65535, or 0 (the default) "
              "for $MASTER_PORT.");
}

LaunchEnv parse_launch_env(const ProcessGroupOptions& options, const std::function<const char*(const char*)>& get) {
  check_set_options(options);
  LaunchEnv env;
  const bool from_mpi = options.world_size() <= 0 && options.rank() < 0 && get("WORLD_SIZE") == nullptr &&
      get("RANK") == nullptr && read_mpi_launcher(env, get);
  if (!from_mpi) {
    read_torchrun_env(env, options, get);
  }
  TORCH_CHECK(
      env.rank >= 0 && env.rank < env.world_size, "lockstep: rank ", env.rank, " is out of range for world size ",
      env.world_size, "; expected 0 <= rank < world_size.");
  TORCH_CHECK(options.timeout().count() >= 0, "lockstep: ProcessGroupOptions::timeout is ", options.timeout().count(),
              " ms; expected a positive duration, or 0 for $LOCKSTEP_TIMEOUT (else ", kDefaultTimeout.count(), " ms).");
  if (options.timeout().count() > 0) {
    check_timeout(options.timeout(), "ProcessGroupOptions::timeout");
    env.timeout = options.timeout();
  } else if (const char* v = get("LOCKSTEP_TIMEOUT")) {
    env.timeout = std::chrono::seconds(
        parse_int("LOCKSTEP_TIMEOUT", v, 1, 7 * 24 * 3600, "whole seconds from 1 to 604800 (a week)"));
  }
  if (const char* v = get("TORCHELASTIC_RESTART_COUNT")) {
    env.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", v, 0, INT32_MAX, "a whole number >= 0");
  }
  if (env.world_size == 1 || (from_mpi && get("MASTER_ADDR") == nullptr && options.master_addr().empty())) {
    return env; // no store needed: one rank, or an MPI job without one
  }
  const char* agent_store = get("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent_store != nullptr && std::string(agent_store) == "True";
  env.master_addr = options.master_addr();
  if (env.master_addr.empty()) {
    const char* addr = get("MASTER_ADDR");
    TORCH_CHECK(addr != nullptr && *addr != '\0', "lockstep: environment variable MASTER_ADDR is not set; expected the "
                "host name or IP address of rank 0 (for one machine, 127.0.0.1). Launch with lockstep-run or "
                "torchrun, or pass master_addr in ProcessGroupOptions.");
    env.master_addr = addr;
  }
  if (from_mpi && options.master_port() == 0 && get("MASTER_PORT") == nullptr) {
    return env; // the mpi backend needs no store; init_process_group asks for the port where one is needed
  }
  env.master_port = options.master_port() > 0 ? options.master_port()
                                              : parse_int("MASTER_PORT", get("MASTER_PORT"), 1, 65535, "a port number in [1, 65535]");
  TORCH_CHECK(
      env.master_port >= 1 && env.master_port <= 65535, "lockstep: master_port ", env.master_port,
      " is not a port number; expected 1 to 65535.");
  return env;
}

} // namespace detail
} // namespace lockstep
