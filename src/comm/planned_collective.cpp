#include "comm/planned_collective.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>

namespace lockstep {
namespace detail {

// Note [Planned collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Note [Ranks agree before they send] costs each collective a round trip
// before it starts. DistributedDataParallel's bucket allreduces are a plan:
// the same collectives, of the same sizes, in the same order, every
// backward until the buckets are rebuilt. So the ranks agree on the whole
// plan once, when it is made (agree_on_plan: one checked all_gather of every
// item's size and dtype), and then send its items with no check before them,
// on a backend that can only pair a collective with one of its own kind
// (GroupImpl::pairs_collectives_by_kind: Gloo, whose collectives of each kind
// have their own slots, and which sends nothing until the receiver waits on
// the same slot; and Gloo and MPI between ranks of one host, through shared
// memory, where every collective's header names its kind).
//
// Why sizes still cannot differ there: the checks are all_gathers and the
// plan's items allreduces, so a plan item that meets another rank's check
// (or any collective but an allreduce) moves no bytes, and both wait until
// the group's timeout, which fails them with an error naming each
// collective. Between ranks on one host, where both go through shared
// memory (Note [Collectives through shared memory]), each sees in the
// other's header that its kind differs, or that one is planned and the other
// not, and both fail at once. A rank passes a check only when every rank was at a check, so
// every allreduce that does pair is the k-th planned collective on both
// sides; the plan was agreed when it was made, and each backward sends
// every item in its order, so the k-th items have one size.
//
// What can still differ is which item, of which plan, a rank sends: two
// models wrapped over one group whose backwards run in another order on one
// rank, with buckets of equal size. So each planned collective carries words
// at the end of its tensor: its plan's id, its item and its number among the
// group's collectives (the flight record's). Each rank writes its words in a
// slot of its own and zeros in the others' (write_plan_words), so that after
// the sum each slot holds one rank's words exactly: words are kDigits
// base-256 digits, integers that every floating-point dtype, bfloat16
// included, holds and adds to zero exactly. Every rank then reads every
// rank's words once the allreduce completes, before its result is used, and
// a difference is an error on every rank, the same text on each. The
// allreduce has moved the sums of other collectives by then, which is why the
// result is not used; the ranks stay paired, since the sizes agreed.
//
// Note [A switch of plans is checked]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The argument above holds within one plan. Two plans, such as two models'
// whose backwards run in another order on one rank, would meet item against
// item: of one size, the words catch it; of two sizes, Gloo's loop thread
// ends the process on the message of the wrong length, where no error can be
// thrown. So a group remembers the plan of its last planned collective, and
// an item of another plan keeps the check before it: the first of a group's
// plans, and each switch, as when a GAN's two models take turns. By
// induction, ranks that have completed the same collectives remember the same
// plan: a check passes only where every rank runs an item of one plan (the
// fingerprint holds its tag: the model and the bucket), and a planned
// collective pairs only with another rank's planned one, which both send for
// the plan they remember. So a planned item meets only the same plan's items,
// and a rank that switched meets the others' check or fails with them at the
// group's timeout. A model trained alone switches once, and every later item
// goes without a round trip.
//
// Everything else keeps the check before sending: broadcasts and barriers,
// all_gathers and reduce-scatters other than those of Note [Planned rings],
// collectives that no plan marks (user calls, SyncBatchNorm, the small ones
// at the end of a backward), every collective over MPI between hosts or
// NCCL (which match collectives by their order alone, so an allreduce
// meeting a check would read the wrong bytes), and every collective under
// LOCKSTEP_DEBUG=detail, which compares each one's shape.

// Note [Planned rings]
// ~~~~~~~~~~~~~~~~~~~~
// FullyShardedDataParallel's backward is a plan too: every backward gathers
// and reduce-scatters the same units in the same order, so its collectives
// go as a recurring plan (Note [Recurring plans]), started by each backward,
// whose items are each collective's kind, size, dtype and tag (its bucket:
// Note [Collective tags]). Forward's gathers keep the check before each. A
// forward may read its units in another order on some rank (a branch on the
// rank or on the data), and a planned collective that meets another rank's
// checked one can only fail at the group's timeout, where the check fails at
// once, naming both. Backward's order follows from forward's, which its
// checked gathers have just shown to be the same on every rank.
// Over Gloo these collectives run as Lockstep's rings of send and receive
// (Note [Gloo's reduce-scatter] in src/comm/backends/gloo_rings.cpp), and the
// argument of Note [Planned collectives] holds for them: the check is an
// all_gather on Gloo's own slots and a ring sends on tags of its own, so a
// planned ring that meets a check moves no bytes (in shared memory, where
// both are, each sees that the other's is planned, and both fail at once); a
// ring pairs only with the
// ring of the same number, which between two checks is the same item of
// the agreed plan on every rank.
// The words cannot ride in the data: an all-gather's output is the units'
// flat parameters, rank after rank, and a reduce-scatter hands each rank
// only its own chunk. So each step of a ring sends, beside its data and on
// a tag of its own, the words of one rank: at step s, rank r passes on
// those of rank r-s, as the all-gather passes on shards, and after W-1
// steps every rank holds every rank's words (CarriesPlanWords). A message
// of kDigits doubles per step, posted with the data, costs no round trip.
// Every rank compares them as for an allreduce once the ring completes.
// Backends that do not carry them (MPI, NCCL, CUDA tensors over Gloo) keep
// the check before each.

namespace {

constexpr int64_t kDigitBase = 256;
constexpr int64_t kPlanDigits = 2, kItemDigits = 2, kSeqDigits = 4;
constexpr int64_t kDigits = kPlanDigits + kItemDigits + kSeqDigits;
constexpr int kMaxPlanRanks = 256; // 2048 elements of words per collective

thread_local int64_t current_plan = -1;
thread_local int64_t current_item = 0;

std::mutex labels_mutex;
std::map<int64_t, std::string>& labels() {
  static std::map<int64_t, std::string> by_id; // plan id -> what it plans
  return by_id;
}

std::string label_of(int64_t plan) {
  std::lock_guard<std::mutex> lock(labels_mutex);
  auto found = labels().find(plan);
  return found == labels().end() ? "a plan this process did not make" : found->second;
}

// The exchange of agree_on_plan: rank 0's id for the plan, the number of
// items, their elements, a hash of every item, and the first items shown.
constexpr size_t kShownItems = 6;
enum PlanField : size_t { kProposal, kItems, kTotal, kHash, kShown, kPlanFields = kShown + 2 * kShownItems };

std::array<int64_t, kPlanFields> digest_of(const std::vector<PlanItem>& items, int64_t proposal) {
  std::array<int64_t, kPlanFields> d{};
  d[kProposal] = proposal;
  d[kItems] = static_cast<int64_t>(items.size());
  uint64_t hash = 1469598103934665603ull; // FNV-1a
  for (size_t i = 0; i < items.size(); ++i) {
    d[kTotal] += items[i].elements;
    for (int64_t v : {items[i].elements, static_cast<int64_t>(items[i].dtype), items[i].kind, items[i].tag}) {
      hash = (hash ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    }
    if (i < kShownItems) {
      d[kShown + 2 * i] = items[i].elements;
      d[kShown + 2 * i + 1] = static_cast<int64_t>(items[i].dtype);
    }
  }
  d[kHash] = static_cast<int64_t>(hash >> 1);
  return d;
}

std::string items_of(const int64_t* d) {
  std::ostringstream out;
  out << d[kItems] << " (" << d[kTotal] << " elements): [";
  for (int64_t i = 0; i < std::min<int64_t>(d[kItems], kShownItems); ++i) {
    const int64_t dtype = d[kShown + 2 * i + 1];
    const bool known = dtype >= 0 && dtype < static_cast<int64_t>(c10::ScalarType::NumOptions);
    out << (i ? ", " : "") << d[kShown + 2 * i] << " "
        << (known ? c10::toString(static_cast<c10::ScalarType>(dtype)) : "?");
  }
  out << (d[kItems] > static_cast<int64_t>(kShownItems) ? ", ...]" : "]");
  return out.str();
}

std::array<int64_t, kDigits> digits_of(const PlanWords& words) {
  std::array<int64_t, kDigits> digits{};
  auto put = [&](int64_t value, int64_t at, int64_t count) {
    auto v = static_cast<uint64_t>(value);
    for (int64_t k = 0; k < count; ++k, v /= kDigitBase) {
      digits[at + k] = static_cast<int64_t>(v % kDigitBase);
    }
  };
  put(words.plan, 0, kPlanDigits);
  put(words.item, kPlanDigits, kItemDigits);
  put(words.seq, kPlanDigits + kItemDigits, kSeqDigits);
  return digits;
}

// A slot's words; false where it holds something no rank writes.
bool words_of(const double* slot, PlanWords& words) {
  auto take = [&](int64_t at, int64_t count, int64_t& value) {
    value = 0;
    for (int64_t k = count - 1; k >= 0; --k) {
      const double digit = slot[at + k];
      if (!(digit >= 0 && digit < kDigitBase && digit == static_cast<double>(static_cast<int64_t>(digit)))) {
        return false;
      }
      value = value * kDigitBase + static_cast<int64_t>(digit);
    }
    return true;
  };
  return take(0, kPlanDigits, words.plan) && take(kPlanDigits, kItemDigits, words.item) &&
         take(kPlanDigits + kItemDigits, kSeqDigits, words.seq);
}

std::string sent(const PlanWords& w) {
  return "item " + std::to_string(w.item) + " of plan " + std::to_string(w.plan) + " (" + label_of(w.plan) +
         ") as its collective #" + std::to_string(w.seq);
}

} // namespace

int64_t agree_on_plan(const ProcessGroup& group, const std::string& label, const std::vector<PlanItem>& items,
                      torch::Device device, const std::string& hint) {
  static std::atomic<int64_t> next_id{0};
  const int64_t proposal = next_id++ % (kDigitBase * kDigitBase);
  const auto mine = digest_of(items, proposal);
  auto local = torch::tensor(std::vector<int64_t>(mine.begin(), mine.end()), torch::kLong).to(device);
  auto all = torch::empty({group.size() * static_cast<int64_t>(kPlanFields)}, local.options());
  group.all_gather_into_async(all, local, "the agreement on " + label)->wait();
  all = all.cpu();
  const int64_t* ours = all.data_ptr<int64_t>();
  for (int r = 1; r < group.size(); ++r) {
    const int64_t* theirs = ours + r * kPlanFields;
    const bool same = std::equal(ours + kItems, ours + kPlanFields, theirs + kItems);
    TORCH_CHECK(same, "lockstep: rank ", group.rank(), " of ", group.size(), ": ranks disagree on ", label,
                ", so none of them was sent: rank 0 plans ", items_of(ours), " but rank ", r, " plans ",
                items_of(theirs), ". ", hint);
  }
  const int64_t id = ours[kProposal];
  std::lock_guard<std::mutex> lock(labels_mutex);
  labels()[id] = label;
  return id;
}

// Note [Recurring plans]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A comm hook's collectives (PowerSGD's: each bucket's P, then one Q for
// all) are not known before its first iteration sends them, and a P must
// go while backward still runs, before the next bucket exists. So the plan
// is what the last iteration sent: the first iteration's collectives are
// checked as any other, and recorded; the next iteration starts with one
// agreement on that record (agree_on_plan) and sends its collectives as
// planned items while each has the agreed item's size and dtype, in order.
// From the first that differs (a bucket laid out anew, or another dtype),
// the rest of the iteration is checked, and the iteration after agrees on
// the new record. Every rank sees the same record in a job that runs the
// same code, so every rank leaves the plan at the same collective and
// agrees at the same step. A rank whose record differs throws, with every
// other, at that agreement; one that leaves the plan alone sends a checked
// collective against the others' planned ones, which pair with nothing,
// and every rank fails at the group's timeout, naming its collective.

RecurringPlan::RecurringPlan(std::string label, std::string hint) : label_(std::move(label)), hint_(std::move(hint)) {}

void RecurringPlan::start_iteration(const ProcessGroup& group, torch::Device device) {
  if (!sent_.empty() && (plan_ < 0 || sent_ != agreed_)) {
    plan_ = -1; // agree_on_plan may throw: no plan until it returns
    agreed_ = std::move(sent_);
    plan_ = agree_on_plan(group, label_, agreed_, device, hint_);
  }
  sent_.clear();
  on_plan_ = plan_ >= 0;
}

std::pair<int64_t, int64_t> RecurringPlan::next(const PlanItem& item) {
  const size_t index = sent_.size();
  sent_.push_back(item);
  on_plan_ = on_plan_ && index < agreed_.size() && agreed_[index] == item;
  return {on_plan_ ? plan_ : -1, static_cast<int64_t>(index)};
}

int64_t plan_words_elements(int size) {
  return size >= 2 && size <= kMaxPlanRanks ? size * kDigits : 0; // a group of one is not checked
}

PlannedCollective::PlannedCollective(int64_t plan, int64_t item)
    : previous_plan_(current_plan), previous_item_(current_item) {
  current_plan = plan;
  current_item = item;
}

PlannedCollective::~PlannedCollective() {
  current_plan = previous_plan_;
  current_item = previous_item_;
}

PlanWords current_plan_words() {
  PlanWords words;
  words.plan = current_plan;
  words.item = current_item;
  return words;
}

void write_plan_words(torch::Tensor room, int rank, int size, const PlanWords& words, bool averaged) {
  TORCH_INTERNAL_ASSERT(room.numel() == plan_words_elements(size) && rank < size);
  TORCH_INTERNAL_ASSERT(!averaged || room.scalar_type() == torch::kFloat || room.scalar_type() == torch::kDouble,
                        "averaged words need a float or double tensor");
  auto digits = digits_of(words);
  for (auto& d : digits) {
    d *= averaged ? size : 1; // below 256 * kMaxPlanRanks = 2^16: float holds it, and its quotient, exactly
  }
  room.zero_();
  room.narrow(0, rank * kDigits, kDigits)
      .copy_(torch::tensor(std::vector<int64_t>(digits.begin(), digits.end()), torch::kLong));
}

std::string plan_words_disagreement(const torch::Tensor& room, int size) {
  TORCH_INTERNAL_ASSERT(room.numel() == plan_words_elements(size));
  const auto values = room.to(torch::kDouble).contiguous();
  const double* slots = values.data_ptr<double>();
  PlanWords reference;
  for (int r = 0; r < size; ++r) {
    PlanWords theirs;
    if (!words_of(slots + r * kDigits, theirs)) {
      return "ranks disagree on this collective, found once it completed, so its result is not used: rank " +
             std::to_string(r) + " sent it without the words of a planned collective (Note [Planned collectives] "
             "in src/comm/planned_collective.cpp), as if it sent a collective of its own of the same size. "
             "Every rank must call the same collectives in the same order.";
    }
    if (r == 0) {
      reference = theirs;
    } else if (theirs.plan != reference.plan || theirs.item != reference.item || theirs.seq != reference.seq) {
      return "ranks disagree on this collective, found once it completed, so its result is not used: rank 0 sent " +
             sent(reference) + " but rank " + std::to_string(r) + " sent " + sent(theirs) +
             ". Every rank must call the same collectives in the same order: look for models whose backwards "
             "run in another order, or a collective that only some ranks call.";
    }
  }
  return "";
}

} // namespace detail
} // namespace lockstep
