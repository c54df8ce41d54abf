#pragma once

// Internal: whether the ranks of a group share a host, and whether a process
// of this host has exited, for the collectives through shared memory (Note
// [Collectives through shared memory] in
// src/comm/backends/shared_memory_collectives.cpp).

#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// What a rank publishes of its host: the host name, the boot and the
/// namespaces that shared memory and process ids live in. Ranks whose
/// identities are equal can map each other's segments.
std::string host_identity();

/// Whether ranks that published `published` (each "off", or
/// "<identity> <segment> <pid>") can all share memory: none is off, and every
/// identity is the first one's.
bool one_host(const std::vector<std::string>& published);

/// Whether process `pid` of this host has exited: gone, or a zombie whose
/// parent has not reaped it yet (kill(pid, 0) still succeeds on one).
bool process_exited(int pid);

} // namespace detail
} // namespace lockstep
