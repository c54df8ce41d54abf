#pragma once

// Internal: the errors of a collective, the same words whichever backend ran
// it: one that failed or timed out (throw_collective_error), one this rank
// refused before sending anything (throw_refusal). Defined in
// src/comm/collective_errors.cpp; the backends and the c10d adapter raise them.

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace lockstep {
namespace detail {

/// What a backend can add to a failed collective's error: which peers it
/// finds unreachable, say (Note [Naming the lost peer], src/comm/backends/gloo.cpp).
/// Null: nothing. Shared, because a group hands it to every collective it
/// starts, and what it captures (every rank's endpoint) grows with the job.
using Diagnose = std::shared_ptr<const std::function<std::string()>>;

/// Rethrows a failed collective as a c10::Error naming it, the rank and the
/// group's timeout (Gloo reports a stopped peer as a timeout or a closed
/// connection), and what `diagnose` finds.
[[noreturn]] void throw_collective_error(
    const std::string& what,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& cause,
    const Diagnose& diagnose = {});

/// Throws the c10::Error of a collective this rank refused (its backend, or
/// lockstep, found an argument wrong) before sending anything: unlike
/// throw_collective_error's, no other rank is at fault.
[[noreturn]] void throw_refusal(
    const std::string& what,
    int rank,
    int size,
    const std::string& backend,
    const std::string& cause);

} // namespace detail
} // namespace lockstep
