#pragma once

// Internal: collectives of a plan that every rank agreed on once (DDP's
// buckets, PowerSGD's allreduces, FSDP's backward), which the agreement check
// then lets go without a round trip before each, checking words they carry
// instead (Note [Planned collectives] and Note [Planned rings] in
// src/comm/planned_collective.cpp).

#include <lockstep/process_group.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

/// One collective of a plan: its tensor's elements (an allreduce's: the
/// words' room included; an all-gather's: this rank's part), dtype, kind (a
/// fingerprint::Kind) and tag (Note [Collective tags]).
struct PlanItem {
  int64_t elements = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t kind = 0; // fingerprint::kAllreduce
  int64_t tag = 0;
  bool operator==(const PlanItem& other) const {
    return elements == other.elements && dtype == other.dtype && kind == other.kind && tag == other.tag;
  }
};

/// Every rank's `items` compared in one checked all_gather on `device`.
/// Equal, every rank returns the same id for the plan; otherwise every rank
/// throws, naming `label` ("DistributedDataParallel's buckets") and the
/// first ranks whose plans differ, followed by `hint` (where to look).
int64_t agree_on_plan(const ProcessGroup& group, const std::string& label, const std::vector<PlanItem>& items,
                      torch::Device device, const std::string& hint);

/// The collectives a caller sends again every iteration, in one order
/// (PowerSGD's P's and Q's, FSDP's backward all-gathers and reduce-scatters),
/// planned from what the last iteration sent: Note [Recurring plans] in
/// src/comm/planned_collective.cpp.
class RecurringPlan {
 public:
  RecurringPlan(std::string label, std::string hint);
  /// Where what the last iteration sent is not the plan agreed, agrees on
  /// it (agree_on_plan, which throws where ranks differ); then starts this
  /// iteration's record.
  void start_iteration(const ProcessGroup& group, torch::Device device);
  /// Records the iteration's next collective, `item`. Returns its plan and
  /// its index in it, or plan -1 where it does not follow the agreed plan
  /// (nor does any later one of this iteration): the collective is then
  /// checked as any other.
  std::pair<int64_t, int64_t> next(const PlanItem& item);

 private:
  std::string label_, hint_;
  std::vector<PlanItem> agreed_, sent_;
  int64_t plan_ = -1;
  bool on_plan_ = false;
};

/// How many elements a planned collective keeps free at the end of its
/// tensor for the words, in a group of `size` ranks; 0 where the group is
/// too large to carry them (its collectives are then checked as any other).
int64_t plan_words_elements(int size);

/// While alive, the collective this thread starts is item `item` of the
/// plan `plan`: an allreduce (Sum, or Avg where the backend averages) whose tensor's last plan_words_elements()
/// elements are free for the words, or an all-gather or reduce-scatter,
/// whose words a backend that carries them sends beside it (Note [Planned
/// rings]); any other is checked as before.
class PlannedCollective {
 public:
  PlannedCollective(int64_t plan, int64_t item);
  ~PlannedCollective();
  PlannedCollective(const PlannedCollective&) = delete;
  PlannedCollective& operator=(const PlannedCollective&) = delete;

 private:
  int64_t previous_plan_, previous_item_;
};

/// What a planned collective says of itself: its plan, its item, and its
/// number among its group's collectives.
struct PlanWords {
  int64_t plan = -1, item = 0, seq = 0;
};

/// The plan and item a PlannedCollective marks on this thread; plan -1
/// where none does.
PlanWords current_plan_words();

/// Writes `words` into rank `rank`'s slot of `room` (plan_words_elements(size)
/// elements of a floating-point tensor) and zeros the other ranks' slots, so
/// that after an allreduce (Sum) each slot holds its rank's words exactly.
/// `averaged`: the allreduce is an Avg that the backend divides (a float or
/// double tensor), so each digit goes in times `size`, which the division
/// leaves exactly.
void write_plan_words(torch::Tensor room, int rank, int size, const PlanWords& words, bool averaged = false);

/// After the allreduce: "" when every rank's words in `room` equal rank 0's,
/// otherwise the error every rank raises, naming both.
std::string plan_words_disagreement(const torch::Tensor& room, int size);

/// A backend whose all-gathers and reduce-scatters can carry a planned
/// collective's words beside their data (Note [Planned rings]): Gloo's
/// rings. The agreement check asks before it lets one go unchecked.
class CarriesPlanWords {
 public:
  virtual ~CarriesPlanWords() = default;
  virtual bool carries_plan_words(torch::Device device) const = 0;
  /// As GroupImpl's all_gather and reduce_scatter, with `words`
  /// (plan_words_elements(size()) doubles, this rank's slot written by
  /// write_plan_words): by the time the Work completes, each rank's slot
  /// holds what that rank wrote.
  virtual std::shared_ptr<Work> planned_all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input,
                                                   std::string what, torch::Tensor words) = 0;
  virtual std::shared_ptr<Work> planned_reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op,
                                                       std::string what, torch::Tensor words) = 0;
};

} // namespace detail
} // namespace lockstep
