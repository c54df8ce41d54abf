#pragma once

// Internal: what the agreement check compares of a collective (Note [Ranks
// agree before they send] in src/comm/collective_check.cpp), and how it
// words a difference. Callers name their collectives with CollectiveTag and
// CallerView; CheckedGroup fingerprints them.

#include <lockstep/backend.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// While alive, collectives this thread starts carry `tag` in the check's
/// fingerprint (Note [Collective tags] in src/comm/collective_fingerprint.cpp): two
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

/// The tag that collectives this thread starts now carry (0: none).
int64_t current_collective_tag();

/// A number for a wrapper (DistributedDataParallel, FullyShardedDataParallel)
/// that this process has not proposed before. Ranks exchange their
/// proposals at construction and take rank 0's: the same on every rank, and
/// different for each wrapper over a group (Note [Collective tags]).
int64_t propose_model_number();

/// The tag of a wrapped model's collective: its model number and a part of
/// it (a bucket; 0 for the wrapper's others).
int64_t model_tag(int64_t model, int64_t part);

/// The tag of SyncBatchNorm layer `layer` (from 1) of wrapped model `model`,
/// apart from every bucket's tag.
int64_t layer_tag(int64_t model, int64_t layer);

/// The tag of a collective about one optimizer (GradScaler's found-inf
/// agreement): a hash of its parameters' shapes, apart from every model's
/// tags. Optimizers of one layout share it.
int64_t optimizer_tag(const std::vector<torch::Tensor>& params);

/// The reduction (a ReduceOp) and the dtype of the collective a CallerView
/// describes on this thread; `reduction` and `dtype` where none does, or for
/// a collective without a reduction. The flight record shows them.
int64_t caller_reduction(int64_t reduction);
c10::ScalarType caller_dtype(c10::ScalarType dtype);

/// While alive, collectives this thread starts are fingerprinted as the
/// caller made them (Note [The caller's collective] in
/// src/comm/collective_fingerprint.cpp): `tensors` before ProcessGroup packed them into
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

// What the check compares: in a namespace of its own, as the flight recorder
// has its own names for the kinds of collective.
namespace fingerprint {

enum Kind : int64_t { kAllreduce = 0, kBroadcast = 1, kAllGather = 2, kBarrier = 3, kReduceScatter = 4 };
constexpr size_t kShownDims = 5;
// kind, reduction or root, dtype, elements, tag, tensors, shapes' hash; then
// Note [LOCKSTEP_DEBUG=detail]'s: the mode (1: detail), the collective's
// number, and the backend's first tensor's dimensions and first sizes.
enum Field : size_t { kKind, kArg, kDtype, kElements, kTag, kCount, kLayout, kDetail, kSeq, kDims, kSizes,
                      kFields = kSizes + kShownDims };
using Fingerprint = std::array<int64_t, kFields>;

/// The fingerprint of a collective of `kind` with `arg` (its reduction or
/// root) of the backend's `tensors`, as this thread's CollectiveTag and
/// CallerView describe it.
Fingerprint fingerprint_of(Kind kind, int64_t arg, const std::vector<torch::Tensor>& tensors);

/// Note [LOCKSTEP_DEBUG=detail]'s fields: the collective's number `seq`,
/// and the shape of the backend's first tensor.
void add_detail(Fingerprint& f, int64_t seq, const std::vector<torch::Tensor>& tensors);

/// The error every rank throws when rank `r`'s fingerprint `theirs` differs
/// from rank 0's `reference`.
std::string disagreement(const int64_t* reference, const int64_t* theirs, int r);

} // namespace fingerprint

} // namespace detail
} // namespace lockstep
