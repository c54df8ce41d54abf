// How long a wait on a collective polls before it sleeps, for the gloo and
// mpi backends.

#include "comm/backends/backends.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>

namespace lockstep {
namespace detail {

// Note [Polling before a wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A rank that sleeps in the wait for a collective leaves its core idle,
// and an idle core may halt. When the collective's last message arrives,
// the thread that receives it, and then the waiting one, are woken on
// cores that must first leave their idle state: on a virtual machine whose
// host deschedules halted vCPUs, that takes milliseconds. Between two
// ranks of a 2-vCPU Firecracker VM, an allreduce of 4 KiB over Gloo took a
// median of 2.8 ms when the ranks came to it from a 5 ms sleep, and 0.4 ms
// when they ran allreduces back to back; in the network lab at 1 Gb/s,
// PowerSGD's step waited 3 ms for its Q allreduce of 45 KB. So a wait on
// the gloo group's collectives (c10d's, the rings', and those through shared
// memory) and the mpi group's (run on its communication thread) first
// polls for kWaitSpin, yielding its core to any thread that can run, and
// only then sleeps, as Open MPI and NCCL poll inside their own calls. A
// wait that outlasts the poll has spent a little of a core on which its
// rank had nothing else to do. DDP over MPI on 2 ranks of one core each ran
// 1.01 x (MLP) and 1.05 x (deep model) the steps per second with the poll
// than without (docs/performance.md). LOCKSTEP_GLOO_SPIN_US and
// LOCKSTEP_MPI_SPIN_US set the time; 0 sleeps at once.
constexpr std::chrono::microseconds kWaitSpin{2000};

std::chrono::microseconds wait_spin(const char* variable, const char* collectives) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') {
    return kWaitSpin;
  }
  char* end = nullptr;
  errno = 0;
  const long us = std::strtol(env, &end, 10);
  TORCH_CHECK(*end == '\0' && errno == 0 && us >= 0 && us <= 1000000, "lockstep: ", variable, "=", env,
              " is not a whole number of microseconds from 0 to 1000000: it is how long a wait on ", collectives,
              " polls before it sleeps (Note [Polling before a wait]); 0 sleeps at once. Unset it for the default, ",
              kWaitSpin.count(), ".");
  return std::chrono::microseconds(us);
}

} // namespace detail
} // namespace lockstep
