#include <lockstep/powersgd.h>
#include <lockstep/timeline.h>

#include "comm/planned_collective.h"
#include "ddp/powersgd_kernels.h"
#include "ddp/powersgd_plan.h"

#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

// Note [PowerSGD]
// ~~~~~~~~~~~~~~~
// One bucket, once compression has started (PyTorch's powerSGD_hook):
//  1. Error feedback: what compression lost from this rank's gradients last
//     iteration is added to them, and a copy of the sum is kept.
//  2. The bucket's gradients split in two (plan_powersgd): matrices worth
//     compressing, M (n x m, a parameter viewed as size(0) x the rest), and
//     the rest, sent whole. Each M gets Q (m x r): last iteration's under
//     warm start, else drawn from the seed (the same on every rank), then
//     orthonormalised; and P = M Q.
//  3. One allreduce averages the whole gradients and every P together
//     (PyTorch sends them as two; one round trip fewer matters on a slow
//     link; it sums and divides after, which overflows float16 sooner).
//  4. Once it is done: the whole gradients go into the bucket; each P (the
//     same on every rank) is orthonormalised, Q = M^T P, and a second
//     allreduce averages the Q's.
//  5. M = P Q^T goes into the bucket; the error is the kept copy minus
//     that.
// Step 4 needs step 3's result, and every rank must issue its collectives
// in the same order, so it cannot run whenever step 3 happens to finish.
// It runs when the reducer waits for the first bucket at the end of
// backward, for every bucket whose step 3 was issued, in bucket order, and
// one allreduce carries the Q's of all of them; each bucket's wait then
// finishes with step 5. So the P round trips overlap backward, and the Q's
// cost one round trip a step, however many buckets there are. From the
// second compressed iteration on, the P's and Q's go as a plan, with no
// agreement round trip before each (Note [Recurring plans]); each carries
// the words' room at its end.
//
// The first iterations (start_iteration) are plain allreduces:
// compressing early gradients costs accuracy. The state is kept by
// parameter, not by bucket, so compression may start at once: DDP's
// rebuilt buckets, and a resumed run's, find it. A zero column of P or Q (a layer with no gradient) stays
// zero where PyTorch's orthogonalisation divides by its zero norm.

// Note [PowerSGD's state]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Two results must not become the state kept for the next iteration: a Q
// with a zero column, which warm start would keep forever (Q = 0 gives
// P = M Q = 0 and Q = M^T P = 0 whatever M is, so a layer whose gradient
// was once zero on every rank, as LoRA's A while B = 0, would never train
// again), and anything not finite, which a loss scaler's overflow brings
// (float16 training skips such steps, but an error of inf - inf = NaN
// added to every later gradient would make every step overflow). Both are
// decided on what the allreduces made the same on every rank, so every
// rank keeps or drops the same state. An overflow is a property of the
// iteration, not of a bucket: the loss scaler skips the whole step, so
// buckets that stayed finite must not keep their new Q and error either (the
// error would carry the skipped step's gradient into later ones, at the
// scale that overflowed). So the rounds' new state is held until the
// iteration's last round finishes, and kept only if all were finite.

namespace lockstep {
namespace detail {

namespace {
class Round;
} // namespace

// Kept by parameter, not by bucket: DistributedDataParallel lays its
// buckets out anew after the first iteration, and again in a resumed run.
struct ParameterMemory {
  torch::Tensor error; // this rank's loss from compressing the parameter's gradient
  torch::Tensor q;     // its Q, flat: where the next power step starts under warm start
};

struct PowerSGDState {
  explicit PowerSGDState(PowerSGDOptions o) : options(std::move(o)) {}
  PowerSGDOptions options;
  std::mutex mutex;
  // Each iteration's P and Q allreduces (Note [Recurring plans]).
  RecurringPlan collectives{"PowerSGD's allreduces",
                            "PowerSGD makes them from DistributedDataParallel's buckets and PowerSGDOptions (rank, "
                            "min_compression_rate): look for one of these that differs between ranks."};
  int64_t iteration = 0;
  double compression_rate = 0;
  int64_t elements = 0, sent = 0; // this iteration's buckets, so far
  std::map<size_t, ParameterMemory> memory; // by GradBucket::parameters' index
  std::deque<std::shared_ptr<Round>> unfinished; // step 3 issued, step 4 not yet
  std::weak_ptr<const void> model; // the DistributedDataParallel this state is of
  bool served = false; // whether `model` was set: a model destroyed since hands on only the iteration
  // Note [PowerSGD's state]: what this iteration's finished rounds would
  // keep, held until its last round finishes.
  struct Iteration {
    std::map<size_t, ParameterMemory> memory; // a field left undefined: drawn anew, or no error
    size_t rounds = 0, finished = 0;
    bool last_started = false, finite = true;
  } now;

  // Every round of the iteration has finished: keep what they made, or, if
  // any result was not finite, the last iteration's state for every bucket.
  void end_iteration() {
    if (now.finite) {
      for (auto& [index, kept] : now.memory) {
        memory[index] = std::move(kept);
      }
    }
    now = Iteration{};
  }
};

namespace {

uint64_t mix(uint64_t x) { // splitmix64: seeds far apart for consecutive draws
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// One bucket's compression in one iteration (steps 1 to 5 of Note [PowerSGD]).
class Round : public PendingReduction {
 public:
  Round(std::shared_ptr<PowerSGDState> state, const ProcessGroup& group, const GradBucket& bucket, PowerSGDPlan plan,
        int64_t iteration)
      : state_(std::move(state)), group_(group), bucket_(bucket), plan_(std::move(plan)), iteration_(iteration) {}

  // Steps 1 to 3, under the state's lock.
  void start();
  // Step 4 up to the Q allreduce, under the state's lock.
  void compute_qs();
  // Step 4 for every round issued so far: one allreduce of all their Q's.
  static void exchange_qs(PowerSGDState& state);
  torch::Tensor wait() override;

 private:
  torch::Tensor error_of(size_t gradient);
  torch::Tensor kept_of(size_t gradient) const;
  void add_errors_to_whole(const std::vector<bool>& compressed);
  void start_qs();
  void finish();
  bool finite_result(const FactorSummary& factors) const;
  ParameterMemory& memory_of(size_t gradient) {
    return state_->memory[bucket_.parameters[gradient]];
  }

  std::shared_ptr<PowerSGDState> state_;
  ProcessGroup group_;
  GradBucket bucket_;
  PowerSGDPlan plan_;
  int64_t iteration_; // the model's, counted from 0
  std::vector<torch::Tensor> matrices_; // each M: views of kept_ under error feedback, else of the bucket
  std::vector<torch::Tensor> products_, ps_, qs_; // views: bucket (where P Q^T goes), first_, q_memory_
  torch::Tensor first_;    // the whole gradients, then every P
  torch::Tensor q_memory_; // every Q
  torch::Tensor kept_;     // the gradients with the error added, for the next error
  std::shared_ptr<Work> first_work_, second_work_; // second_work_ shared by the rounds of one exchange
  bool exchanged_ = false, done_ = false;
};

// Gradient i's error feedback, flat on the bucket's device; undefined
// without error feedback or before the first compressed iteration.
torch::Tensor Round::error_of(size_t i) {
  const auto& error = memory_of(i).error;
  if (!state_->options.error_feedback() || !error.defined()) {
    return {};
  }
  const auto& gradient = bucket_.gradients[i];
  TORCH_CHECK(error.numel() == gradient.numel(), "lockstep::PowerSGD: the error feedback of parameter ",
              bucket_.parameters[i], " (in ", bucket_.name, ") holds ", error.numel(), " elements, but its gradient "
              "has ", gradient.numel(), ": the state was loaded from another model; load the state this model "
              "saved, or none.");
  return error.to(gradient.device()).reshape({-1});
}

// Where gradient i plus its error is kept, flat; undefined without error
// feedback.
torch::Tensor Round::kept_of(size_t i) const {
  return kept_.defined() ? kept_.narrow(0, plan_.offsets[i], bucket_.gradients[i].numel()) : torch::Tensor();
}

// Step 1 for the gradients sent whole: their error is added in the bucket,
// from which the P allreduce takes them, and the sum is kept. The
// compressed ones get theirs in project_, which reads each gradient once
// (Note [PowerSGD's passes over M]).
void Round::add_errors_to_whole(const std::vector<bool>& compressed) {
  for (size_t i = 0; kept_.defined() && i < bucket_.gradients.size(); ++i) {
    if (compressed[i]) {
      continue;
    }
    auto gradient = bucket_.buffer.narrow(0, plan_.offsets[i], bucket_.gradients[i].numel()); // in memory order
    const auto error = error_of(i);
    if (error.defined()) {
      gradient.add_(error);
    }
    kept_of(i).copy_(gradient);
  }
}

// Each matrix's Q: last iteration's under warm start, else drawn from a
// generator seeded by (seed, iteration, parameter): the same on every rank,
// and in a resumed run, whatever the buckets' layout.
void Round::start_qs() {
  q_memory_ = torch::empty({plan_.q_elements}, bucket_.buffer.options());
  for (const auto& m : plan_.matrices) {
    qs_.push_back(q_memory_.narrow(0, m.q_offset, m.cols * m.rank).view({m.cols, m.rank}));
    const auto& kept = memory_of(m.gradient).q;
    if (kept.defined() && state_->options.warm_start()) {
      TORCH_CHECK(kept.numel() == m.cols * m.rank, "lockstep::PowerSGD: the warm-start Q of parameter ",
                  bucket_.parameters[m.gradient], " (in ", bucket_.name, ") holds ", kept.numel(), " elements, but "
                  "an approximation of rank ", m.rank, " (PowerSGDOptions().rank(); lockstep-train's --powersgd-rank) "
                  "needs ", m.cols * m.rank, ": the state was saved with another model, or by an older lockstep "
                  "with another rank.");
      qs_.back().copy_(kept.view_as(qs_.back()));
      continue;
    }
    const uint64_t parameter = bucket_.parameters[m.gradient];
    auto generator = at::detail::createCPUGenerator(
        mix(state_->options.seed() ^ mix(static_cast<uint64_t>(iteration_) ^ mix(parameter))));
    qs_.back().copy_(torch::randn({m.cols, m.rank}, generator, torch::kFloat));
  }
}

void Round::start() {
  timeline::Span span("PowerSGD: P = M Q");
  torch::NoGradGuard no_grad;
  if (state_->options.error_feedback()) {
    // Zeros in gaps between gradients, not whatever the memory held, which
    // a saved state would carry.
    kept_ = plan_.gaps ? torch::zeros({plan_.parameter_elements}, bucket_.buffer.options())
                       : torch::empty({plan_.parameter_elements}, bucket_.buffer.options());
  }
  std::vector<bool> compressed(bucket_.gradients.size(), false);
  for (const auto& m : plan_.matrices) {
    compressed[m.gradient] = true;
  }
  add_errors_to_whole(compressed);
  start_qs();
  // The words' room at the end (Note [Planned collectives]).
  const int64_t room = plan_words_elements(group_.size());
  first_ = torch::empty({plan_.whole_elements + plan_.p_elements + room}, bucket_.buffer.options());
  first_.narrow(0, plan_.whole_elements + plan_.p_elements, room).zero_();
  int64_t at = 0;
  for (const auto& [offset, numel] : plan_.whole) {
    first_.narrow(0, at, numel).copy_(bucket_.buffer.narrow(0, offset, numel));
    at += numel;
  }
  for (size_t i = 0; i < plan_.matrices.size(); ++i) {
    const auto& m = plan_.matrices[i];
    const auto as_matrix = [&](const torch::Tensor& t) { return t.defined() ? t.view({m.rows, m.cols}) : t; };
    products_.push_back(bucket_.buffer.narrow(0, plan_.offsets[m.gradient], m.rows * m.cols).view({m.rows, m.cols}));
    const auto kept = as_matrix(kept_of(m.gradient));
    matrices_.push_back(kept.defined() ? kept : products_.back());
    ps_.push_back(first_.narrow(0, at + m.p_offset, m.rows * m.rank).view({m.rows, m.rank}));
    orthogonalize_(qs_[i]);
    project_(ps_[i], products_[i], as_matrix(error_of(m.gradient)), qs_[i], kept);
  }
  const auto [plan, item] = state_->collectives.next({first_.numel(), first_.scalar_type()});
  PlannedCollective planned(plan, item);
  // Avg, not Sum: Note [Average] divides float16 before it sums, so two
  // ranks' 40000 do not become inf. An averaged P is the summed one's
  // direction, which is all the orthonormalisation keeps.
  first_work_ = group_.allreduce_async({first_}, ReduceOp::Avg, "PowerSGD's P allreduce of " + bucket_.name);
}

void Round::compute_qs() {
  torch::NoGradGuard no_grad;
  {
    timeline::Span span("PowerSGD: wait for the P allreduce");
    first_work_->wait();
  }
  timeline::Span span("PowerSGD: Q = M^T P");
  int64_t at = 0;
  for (const auto& [offset, numel] : plan_.whole) {
    bucket_.buffer.narrow(0, offset, numel).copy_(first_.narrow(0, at, numel));
    at += numel;
  }
  for (size_t i = 0; i < matrices_.size(); ++i) {
    orthogonalize_(ps_[i]);
    project_transposed_(qs_[i], matrices_[i], ps_[i]);
  }
}

// One allreduce carries the Qs of every unfinished round of a dtype and
// device (a collective carries one of each), in the order the rounds came,
// which every rank shares.
void Round::exchange_qs(PowerSGDState& state) {
  struct Batch {
    std::vector<std::shared_ptr<Round>> rounds;
    std::vector<torch::Tensor> qs;
    std::string names;
  };
  std::vector<Batch> batches;
  while (!state.unfinished.empty()) {
    auto round = state.unfinished.front();
    state.unfinished.pop_front();
    round->compute_qs();
    round->exchanged_ = true;
    const auto& q = round->q_memory_;
    if (q.numel() == 0) {
      continue;
    }
    auto batch = std::find_if(batches.begin(), batches.end(), [&](const Batch& b) {
      return b.qs[0].scalar_type() == q.scalar_type() && b.qs[0].device() == q.device();
    });
    if (batch == batches.end()) {
      batch = batches.insert(batches.end(), Batch{});
    }
    batch->rounds.push_back(round);
    batch->qs.push_back(q);
    batch->names += (batch->names.empty() ? "" : ", ") + round->bucket_.name;
  }
  for (auto& batch : batches) {
    const auto& group = batch.rounds.front()->group_;
    const int64_t room = plan_words_elements(group.size());
    if (room > 0) {
      batch.qs.push_back(torch::zeros({room}, batch.qs[0].options())); // the words' (Note [Planned collectives])
    }
    int64_t elements = 0;
    for (const auto& q : batch.qs) {
      elements += q.numel();
    }
    const auto [plan, item] = state.collectives.next({elements, batch.qs[0].scalar_type()});
    PlannedCollective planned(plan, item);
    auto work = group.allreduce_async(batch.qs, ReduceOp::Avg, "PowerSGD's Q allreduce of " + batch.names); // as P's
    for (auto& round : batch.rounds) {
      round->second_work_ = work;
    }
  }
}

void Round::finish() {
  torch::NoGradGuard no_grad;
  if (second_work_) {
    timeline::Span span("PowerSGD: wait for the Q allreduce");
    second_work_->wait();
  }
  timeline::Span span("PowerSGD: M = P Q^T");
  // Under error feedback each matrix's next error, kept minus M, is made as
  // M is written, and the whole gradients' below.
  for (size_t i = 0; i < products_.size(); ++i) {
    low_rank_product_(products_[i], ps_[i], qs_[i], kept_.defined() ? matrices_[i] : torch::Tensor());
  }
  done_ = true;
  auto& now = state_->now;
  // Note [PowerSGD's state]: the averaged gradients and every Q are the
  // same on every rank, so is this decision.
  const auto factors = summarize_factors(plan_, first_.narrow(0, plan_.whole_elements, plan_.p_elements), q_memory_);
  now.finite = now.finite && finite_result(factors);
  if (now.finite) {
    for (size_t i = 0; i < products_.size(); ++i) {
      const bool keep = state_->options.warm_start() && !factors.q_has_zero_column[i]; // else drawn anew
      now.memory[bucket_.parameters[plan_.matrices[i].gradient]].q = keep ? qs_[i].reshape({-1}) : torch::Tensor();
    }
  }
  if (now.finite && kept_.defined()) {
    for (const auto& [offset, numel] : plan_.whole) {
      const int64_t inside = std::min(numel, plan_.parameter_elements - offset); // not what follows the gradients
      if (inside > 0) {
        kept_.narrow(0, offset, inside).sub_(bucket_.buffer.narrow(0, offset, inside));
      }
    }
    for (size_t i = 0; i < bucket_.gradients.size(); ++i) {
      now.memory[bucket_.parameters[i]].error = kept_of(i);
    }
  }
  if (++now.finished == now.rounds && now.last_started) {
    state_->end_iteration();
  }
}

// The largest finite value of `dtype`; 0 for one with no bound to check.
double largest_finite(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::max());
    case torch::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    case torch::kFloat:
      return std::numeric_limits<float>::max();
    case torch::kDouble:
      return std::numeric_limits<double>::max();
    default:
      return 0;
  }
}

// Whether the averaged gradients and every P and Q are finite (Note
// [PowerSGD's state]), without a pass over the bucket: each whole gradient
// is read, and each M = P Q^T is judged by its factors' bound
// (summarize_factors). M itself is read only where that bound does not fit
// its dtype.
bool Round::finite_result(const FactorSummary& factors) const {
  if (!factors.finite) {
    return false;
  }
  int64_t at = 0;
  for (const auto& [offset, numel] : plan_.whole) {
    const int64_t inside = std::min(numel, plan_.parameter_elements - offset); // not what follows the gradients
    if (inside > 0 && !torch::isfinite(first_.narrow(0, at, inside)).all().item<bool>()) {
      return false;
    }
    at += numel;
  }
  const double largest = largest_finite(bucket_.buffer.scalar_type());
  for (size_t i = 0; i < matrices_.size(); ++i) {
    if (!(factors.bound[i] < largest) && !torch::isfinite(products_[i]).all().item<bool>()) {
      return false;
    }
  }
  return true;
}

torch::Tensor Round::wait() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!done_) {
    if (!exchanged_) {
      exchange_qs(*state_); // this round and every one issued after it (Note [PowerSGD])
    }
    TORCH_INTERNAL_ASSERT(exchanged_);
    finish();
  }
  return bucket_.buffer;
}

} // namespace
} // namespace detail

PowerSGD::PowerSGD(PowerSGDOptions options) {
  TORCH_CHECK(options.rank() >= 1, "lockstep::PowerSGDOptions: rank must be at least 1, but got ", options.rank(), ".");
  TORCH_CHECK(options.start_iteration() >= 0, "lockstep::PowerSGDOptions: start_iteration must be >= 0, but got ",
              options.start_iteration(), ".");
  TORCH_CHECK(options.min_compression_rate() > 0, "lockstep::PowerSGDOptions: min_compression_rate must be > 0, but "
              "got ", options.min_compression_rate(), ".");
  state_ = std::make_shared<detail::PowerSGDState>(std::move(options));
}

namespace {

// The state is kept by parameter index and counts iterations by the last
// bucket: two models sharing it would each take the other's error feedback
// and Q's (silently, where their shapes match) and count every step twice.
// A model that has been destroyed hands on its iteration count (a model
// wrapped again), but not the error feedback and Q's: the new wrapper may
// reduce other parameters (one unfrozen shifts every index after it), so
// they start afresh, as when compression starts. A state loaded since is
// the next model's whole.
void check_one_model(detail::PowerSGDState& state, const GradBucket& bucket) {
  const auto theirs = bucket.model.lock();
  if (!theirs) {
    return; // a bucket made by hand
  }
  const auto mine = state.model.lock();
  TORCH_CHECK(!mine || mine == theirs, "lockstep::PowerSGD: ", bucket.name, " comes from a second "
              "DistributedDataParallel, but one PowerSGD serves one model: its error feedback and Q's are kept by "
              "parameter index and its iteration counts one model's steps, so two models would share them. Make one "
              "comm_hooks::powersgd() per DistributedDataParallel.");
  if (!mine) {
    if (state.served) {
      state.memory.clear();
    }
    state.model = bucket.model;
  }
  state.served = true; // a state loaded while this model lives is this model's from its next bucket on
}

} // namespace

std::shared_ptr<PendingReduction> PowerSGD::operator()(const ProcessGroup& group, GradBucket& bucket) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  check_one_model(*state_, bucket);
  const bool compress = state_->iteration >= state_->options.start_iteration();
  if (bucket.index == 0) {
    state_->unfinished.clear(); // rounds an exception left behind in an earlier iteration
    state_->now = detail::PowerSGDState::Iteration{};
  }
  const int64_t iteration = state_->iteration;
  if (bucket.last) {
    ++state_->iteration;
  }
  if (!compress) {
    if (bucket.last) {
      state_->compression_rate = 0; // this iteration's, not a loaded state's (a resume with a later start)
    }
    return comm_hooks::allreduce(group, bucket);
  }
  if (bucket.index == 0) {
    state_->collectives.start_iteration(group, bucket.buffer.device());
  }
  ++state_->now.rounds;
  state_->now.last_started = bucket.last;
  auto plan = detail::plan_powersgd(bucket, state_->options.rank(), state_->options.min_compression_rate());
  if (bucket.index == 0) {
    state_->elements = state_->sent = 0;
  }
  state_->elements += plan.bucket_elements;
  state_->sent += plan.sent();
  if (bucket.last) { // over the whole iteration, as compression_rate() says
    state_->compression_rate =
        state_->sent == 0 ? 1.0 : static_cast<double>(state_->elements) / static_cast<double>(state_->sent);
  }
  auto round = std::make_shared<detail::Round>(state_, group, bucket, std::move(plan), iteration);
  round->start();
  state_->unfinished.push_back(round);
  return round;
}

const PowerSGDOptions& PowerSGD::options() const {
  return state_->options;
}

int64_t PowerSGD::iteration() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->iteration;
}

double PowerSGD::compression_rate() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->compression_rate;
}

void PowerSGD::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  archive.write("iteration", torch::tensor(state_->iteration));
  archive.write("rank", torch::tensor(state_->options.rank()));
  archive.write("compression_rate", torch::tensor(state_->compression_rate, torch::kDouble));
  std::vector<int64_t> indices;
  for (const auto& [index, memory] : state_->memory) {
    indices.push_back(static_cast<int64_t>(index));
    const std::string key = "parameter." + std::to_string(index);
    if (memory.error.defined()) {
      archive.write(key + ".error", memory.error.cpu());
    }
    if (memory.q.defined()) {
      archive.write(key + ".q", memory.q.cpu());
    }
  }
  archive.write("parameters", torch::tensor(indices, torch::kInt64));
}

namespace {

// Note [PowerSGD state of another rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A run resumed with another rank (lockstep-train's --powersgd-rank) finds
// warm start's Q's of the old rank's shape. The iteration and the error
// feedback do not depend on the rank (the error is gradient-shaped), so
// they are kept, and the Q's are drawn anew at the new rank, as at the
// start of compression.
void load_state(detail::PowerSGDState& state, torch::serialize::InputArchive& archive, bool errors) {
  torch::Tensor iteration, parameters, saved_rank;
  const bool same_rank = !archive.try_read("rank", saved_rank) || saved_rank.item<int64_t>() == state.options.rank();
  const bool found = archive.try_read("iteration", iteration) && archive.try_read("parameters", parameters);
  TORCH_CHECK(found && iteration.numel() == 1 && parameters.dim() == 1 &&
                  parameters.scalar_type() == torch::kInt64,
              "lockstep::PowerSGD::load: the archive does not hold a PowerSGD state; load what PowerSGD::save wrote.");
  std::map<size_t, detail::ParameterMemory> memory;
  for (int64_t i = 0; i < parameters.numel(); ++i) {
    const auto index = parameters[i].item<int64_t>();
    const std::string key = "parameter." + std::to_string(index);
    auto& m = memory[static_cast<size_t>(index)];
    if (same_rank) {
      archive.try_read(key + ".q", m.q); // absent without warm start
    }
    if (errors) {
      archive.try_read(key + ".error", m.error); // absent without error feedback
    }
  }
  state.iteration = iteration.item<int64_t>();
  torch::Tensor rate;
  state.compression_rate = archive.try_read("compression_rate", rate) && rate.numel() == 1 ? rate.item<double>() : 0.0;
  state.memory = std::move(memory);
  state.served = false; // the next model's, even where another was served before
  state.unfinished.clear();
}

} // namespace

void PowerSGD::load(torch::serialize::InputArchive& archive) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  load_state(*state_, archive, true);
}

void PowerSGD::load_shared(torch::serialize::InputArchive& archive) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  load_state(*state_, archive, false);
}

namespace comm_hooks {
PowerSGD powersgd(PowerSGDOptions options) {
  return PowerSGD(std::move(options));
}
} // namespace comm_hooks

} // namespace lockstep
