#pragma once

// Internal: the backends this build has. CMake compiles one file of each pair,
// src/comm/backends/<name>.cpp or src/comm/backends/no_<name>.cpp, by what LibTorch
// offers.

#include <lockstep/detail/c10d_group.h>
#include <lockstep/timeline.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace lockstep {
namespace detail {

/// Made by gloo.cpp or no_gloo.cpp, and the NCCL pair.
bool gloo_available();
std::shared_ptr<GroupImpl> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& master_addr,
    int master_port);
bool nccl_available();
std::shared_ptr<GroupImpl> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout);
/// Made by mpi.cpp or no_mpi.cpp. No store: MPI's launcher connected the
/// ranks; `rank` and `size` are checked against MPI's own.
bool mpi_available();
std::shared_ptr<GroupImpl> make_mpi_group(int rank, int size, std::chrono::milliseconds timeout);

/// For gloo.cpp and mpi.cpp: how long a wait on the group's collectives
/// polls before it sleeps (Note [Polling before a wait] in
/// src/comm/backends/polling.cpp): `variable`, in microseconds, else the
/// default; an error naming the variable and `collectives` (what waits)
/// when it is no such number.
std::chrono::microseconds wait_spin(const char* variable, const char* collectives);

/// For gloo.cpp and mpi.cpp: `collective`, for the group's own thread to
/// run, timed there under the name `what` while the timeline records (the
/// collective as it ran: Note [Timeline] in src/util/timeline.cpp); as it is
/// otherwise.
template <typename Result>
std::function<Result()> timed_where_it_runs(std::function<Result()> collective, const std::string& what) {
  if (!timeline::enabled()) {
    return collective;
  }
  return [collective = std::move(collective), what]() {
    const timeline::Span span(what);
    return collective();
  };
}

} // namespace detail
} // namespace lockstep
