#pragma once

// Internal: every rank checks that the others run the same collective, with
// the same sizes, before any of them sends it (Note [Ranks agree before they
// send] in src/comm/collective_check.cpp).

#include <lockstep/backend.h>

#include "comm/collective_fingerprint.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace lockstep {
namespace detail {

/// `impl` with every collective checked against every rank's before it is
/// sent, on a thread of the group's own, so that the caller does not wait;
/// `impl` itself for a group of one. LOCKSTEP_DEBUG=detail (read here, and
/// a value other than detail or off refused) makes the check also number the
/// collectives and compare their shapes (Note [LOCKSTEP_DEBUG=detail] in
/// src/comm/collective_fingerprint.cpp).
std::shared_ptr<GroupImpl> checked(std::shared_ptr<GroupImpl> impl);

} // namespace detail
} // namespace lockstep
