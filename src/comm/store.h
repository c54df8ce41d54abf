#pragma once

// Internal: the store through which init_process_group's ranks find each
// other (src/comm/store.cpp), apart from the backends that use it.

#include "comm/launch_env.h"
#include <lockstep/process_group_options.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace lockstep {
namespace detail {

/// The store for `env`'s job, in init_process_group's order of precedence
/// (process_group.h): lockstep-run's FileStore, torchrun's agent store, or
/// a TCPStore that rank 0 hosts. A MASTER_ADDR that does not resolve, or a
/// store that cannot be started or reached within the timeout, is an error
/// naming the address and what to check.
c10::intrusive_ptr<c10d::Store> make_store(const LaunchEnv& env, const ProcessGroupOptions& options);

} // namespace detail
} // namespace lockstep
