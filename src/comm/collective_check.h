#pragma once

// Internal: every rank checks that the others run the same collective, with
// the same sizes, before any of them sends it (Note [Ranks agree before they
// send] in src/comm/collective_check.cpp).

#include <lockstep/backend.h>

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
/// src/comm/collective_check.cpp).
std::shared_ptr<GroupImpl> checked(std::shared_ptr<GroupImpl> impl);

/// While alive, collectives this thread starts carry `tag` in the check's
/// fingerprint (Note [Collective tags] in src/comm/collective_check.cpp): two
/// ranks at the same point with the same sizes but different tags are an
/// error on every rank. `tag` must name the same collective on every rank.
class CollectiveTag {
 public:
  explicit CollectiveTag(int64_t tag);
  ~CollectiveTag();
  CollectiveTag(const CollectiveTag&) = delete;
  CollectiveTag& operator=(const CollectiveTag&) = delete;

 private:
  int64_t previous_;
};

/// The reduction (a ReduceOp) and the dtype of the collective a CallerView
/// describes on this thread; `reduction` and `dtype` where none does, or for
/// a collective without a reduction. The flight record shows them.
int64_t caller_reduction(int64_t reduction);
c10::ScalarType caller_dtype(c10::ScalarType dtype);

/// While alive, collectives this thread starts are fingerprinted as the
/// caller made them (Note [The caller's collective] in
/// src/comm/collective_check.cpp): `tensors` before ProcessGroup packed them into
/// one flat tensor, and `op` (a ReduceOp, or -1) before Avg became a Sum.
class CallerView {
 public:
  CallerView(const std::vector<torch::Tensor>& tensors, int64_t op);
  ~CallerView();
  CallerView(const CallerView&) = delete;
  CallerView& operator=(const CallerView&) = delete;

 private:
  struct Saved {
    bool set;
    int64_t op, dtype, count, layout;
  } previous_;
};

} // namespace detail
} // namespace lockstep
