#pragma once

// Internal: the launcher's environment (torchrun's variables and lockstep's
// own), parsed without touching the process's environment, so that it can be
// tested as a pure function.

#include <lockstep/process_group_options.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace lockstep {
namespace detail {

/// The longest timeout a group takes (LOCKSTEP_TIMEOUT's bound too): longer
/// ones would overflow the deadlines computed from it.
constexpr std::chrono::milliseconds kMaxTimeout{std::chrono::hours(7 * 24)};

/// `timeout`, checked: above 0 and at most kMaxTimeout, else an error
/// naming `what`.
void check_timeout(std::chrono::milliseconds timeout, const char* what);

/// torchrun's variables, or an MPI launcher's, parsed. A variable that is unset or malformed is a
/// c10::Error naming it and the expected form.
struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  std::string master_addr;
  int64_t master_port = 0;
  /// torchrun's agent already hosts the store on MASTER_PORT
  /// (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects as a client.
  bool agent_store = false;
  /// The MPI launcher whose variables gave rank and size ("Open MPI's
  /// mpirun"), or nullptr under torchrun's variables. See Note [MPI launchers].
  const char* mpi_launcher = nullptr;
  /// TORCHELASTIC_RESTART_COUNT: which attempt of the job this is.
  int64_t restart_count = 0;
  /// The options' timeout, else LOCKSTEP_TIMEOUT's, else kDefaultTimeout.
  /// At most kMaxTimeout.
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

/// `get` looks a variable up (nullptr: unset). Only what `options` leaves
/// unset is read; world size 1 needs neither address nor port. Under an MPI
/// launcher both may be unset (master_port 0): the mpi backend needs no
/// store, and init_process_group refuses a backend that does.
LaunchEnv parse_launch_env(const ProcessGroupOptions& options, const std::function<const char*(const char*)>& get);

/// The MPI launcher whose variables name this process's rank ("Open MPI's
/// mpirun"), or nullptr.
const char* find_mpi_launcher(const std::function<const char*(const char*)>& get);

/// The local rank the launcher gives (LOCAL_RANK, or the MPI launcher's own
/// variable where parse_launch_env reads that launcher), or -1 where it gives
/// none. A malformed value is a c10::Error naming the variable.
int64_t local_rank_of(const std::function<const char*(const char*)>& get);

/// How many ranks the MPI launcher started on this host: its local size,
/// else its world size; 0 where no MPI launcher's variables are set, or they
/// are not whole numbers (the caller decides nothing from it then).
int64_t mpi_ranks_on_this_host(const std::function<const char*(const char*)>& get);

/// Parses a whole decimal number in [low, high]; `name` and `form` word the error.
int64_t parse_int(const std::string& name, const char* value, int64_t low, int64_t high, const char* form);

} // namespace detail
} // namespace lockstep
