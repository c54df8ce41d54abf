#pragma once

// Internal: every rank checks that the others run the same collective, with
// the same sizes, before any of them sends it (Note [Ranks agree before they
// send] in src/collective_check.cpp).

#include <lockstep/process_group.h>

#include <memory>

namespace lockstep {
namespace detail {

/// `impl` with every collective checked against every rank's before it is
/// sent, on a thread of the group's own, so that the caller does not wait;
/// `impl` itself for a group of one.
std::shared_ptr<GroupImpl> checked(std::shared_ptr<GroupImpl> impl);

} // namespace detail
} // namespace lockstep
