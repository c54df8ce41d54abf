#pragma once

// Internal: what runs before a backend ends the process without throwing (the
// mpi backend's MPI_Abort after a timeout). The layers above a backend
// install hooks here (the flight recorder its dump), so that a backend never
// calls up into what wraps it.

#include <functional>
#include <string>

namespace lockstep {
namespace detail {

/// Adds `hook`, which before_abort() runs with its reason, for the life of the process.
void on_before_abort(std::function<void(const std::string&)> hook);
/// Runs every hook, in the order added; one that throws is passed over.
void before_abort(const std::string& reason) noexcept;

} // namespace detail
} // namespace lockstep
