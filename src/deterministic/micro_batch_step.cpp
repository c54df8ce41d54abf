#include "deterministic/micro_batch_step.h"

#include <lockstep/timeline.h>

#include "comm/collective_fingerprint.h"
#include "deterministic/exact_sum.h"
#include "util/sparse_embeddings.h"
#include "util/unique_tensors.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>

namespace lockstep {
namespace detail {

// Note [The same bits at any world size]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A step's global batch is V micro-batches of one size. In deterministic
// mode, rank r of W runs micro-batches r*V/W .. (r+1)*V/W - 1, each alone:
// its forward and backward at the micro-batch's shape, its gradient kept
// apart from the others'. What every micro-batch computes is then the same
// at any W: the same parameters (by induction over the steps), the same
// samples (the caller maps micro-batch v to samples by global index), and
// the same random numbers (the default generator of the CPU and of the
// module's device is seeded from (seed, step, v) for its forward and
// backward, and restored after). Intra-op threads must be as many at every
// W: a matrix product may split its sums by thread.
//
// What differs between W is how the V gradients are added: locally or across
// ranks, in an order set by the ring. A float sum depends on its order. So
// they are added as integers, whose sum does not. For each parameter, the
// ranks first learn the largest |g| over all V micro-batches (M, in an
// all_gather: a max is exact in any order), then scale each gradient by 2^e,
// the largest power of two for which V values below M cannot overflow 2^62,
// and round to int64. Local sums and one allreduce (Sum) of int64 give every
// rank the same integers at any W; the gradient is that sum times 2^-e over
// V, computed in double and rounded to the parameter's dtype (or a
// reduce-scatter and a gather of the gradients: Note [Whole gradients from a
// reduce-scatter]). Each element's
// integer and gradient depend only on that element's terms and its
// parameter's e, so a wrapper may lay the sum out as it likes
// (FixedPointPiece): FullyShardedDataParallel reduce-scatters it into its
// shards (Note [Sharded exact sums] in src/fsdp/deterministic.cpp) and gets
// DistributedDataParallel's bits; DataParallel sums as one rank.
//
// Precision: with t = ceil(log2 V), M * 2^e is at least 2^(61-t), so an
// element keeps every bit of its float value where |g| >= M * 2^(t-38)
// (M * 2^-34 for V = 12); smaller ones are rounded to multiples of 2^-e,
// at most M * 2^(t-61), an error far below a float sum's own near M. The
// other way, fixing one reduction tree over the V micro-batches whose
// subtrees the ranks compute, works only for W whose shares are subtrees
// (powers of two), or sends every micro-batch's gradient whole; int64 costs
// twice a float allreduce's bytes and the maxima's all_gather, at any W.
//
// Other state: a parameter whose maximum is not finite (inf or NaN in some
// micro-batch) gets a NaN gradient on every rank, which GradScaler's and
// clipping's checks see. The losses go in the same all_gather, so every rank
// returns their mean added in micro-batch order, and so do BatchNorm's
// updates (Note [Running statistics over micro-batches] in
// src/deterministic/micro_batch_norms.cpp). Any other buffer that forward changed
// would depend on which micro-batches each rank ran: a hash of every buffer
// as the step starts goes in the all_gather too, and buffers that differ
// between ranks are an error naming the first; so is a buffer other than
// BatchNorm's statistics, or a frozen parameter, that the micro-batches
// changed (its version counter moved and, for a buffer, its bytes), at any
// W, W = 1 included. A parameter to which no micro-batch on any rank gave a
// gradient gets none (DistributedDataParallel, DataParallel), so that the
// optimizer skips it, as PyTorch's DDP leaves a globally unused
// parameter's gradient alone; FullyShardedDataParallel's flat shards hold
// zeros there.

namespace {

// The default generator of `device` (and of the CPU), seeded for one
// micro-batch while alive, then restored, so that the caller's own draws go
// on as if the micro-batch drew nothing.
class SeededGenerators {
 public:
  SeededGenerators(torch::Device device, uint64_t seed) {
    seed_one(torch::Device(torch::kCPU), seed);
    if (!device.is_cpu()) {
      seed_one(device, seed);
    }
  }
  ~SeededGenerators() {
    for (size_t i = 0; i < generators_.size(); ++i) {
      std::lock_guard<std::mutex> lock(generators_[i].mutex());
      generators_[i].set_state(saved_[i]);
    }
  }
  SeededGenerators(const SeededGenerators&) = delete;
  SeededGenerators& operator=(const SeededGenerators&) = delete;

 private:
  void seed_one(torch::Device device, uint64_t seed) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    saved_.push_back(generator.get_state());
    generator.set_current_seed(seed);
    generators_.push_back(generator);
  }
  std::vector<at::Generator> generators_;
  std::vector<torch::Tensor> saved_;
};

// FNV-1a over a tensor's bytes, as a double's bits: the all_gather moves it
// as it is.
double hash_of(const torch::Tensor& tensor) {
  const auto bytes = tensor.detach().cpu().contiguous();
  const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < bytes.nbytes(); ++i) {
    hash = (hash ^ data[i]) * 1099511628211ull;
  }
  double bits = 0;
  std::memcpy(&bits, &hash, sizeof(bits));
  return bits;
}

// BatchNorm's statistics back at the step's start unless the step was
// taken: an error anywhere in it leaves them as it found them.
struct RestoreUnlessTaken {
  explicit RestoreUnlessTaken(MicroBatchNorms& n) : norms(n) {}
  MicroBatchNorms& norms;
  bool taken = false;
  RestoreUnlessTaken(const RestoreUnlessTaken&) = delete;
  RestoreUnlessTaken& operator=(const RestoreUnlessTaken&) = delete;
  ~RestoreUnlessTaken() {
    if (!taken) {
      norms.restore();
    }
  }
};

bool same_bits(double a, double b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

// The larger of two maxima, NaN if either is.
double max_of(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

} // namespace

void check_exactly_summable(torch::nn::Module& module, const std::string& where, bool frozen_too) {
  for (const auto& named : module.named_parameters()) {
    TORCH_CHECK(!named.value().is_complex() || !(frozen_too || named.value().requires_grad()), where,
                "parameter '", named.key(), "' is complex (", named.value().scalar_type(), "); deterministic mode "
                "sums real gradients only. Keep it as a real tensor of twice the elements (torch::view_as_real) and "
                "view it as complex in forward.");
  }
  const auto sparse = first_sparse_embedding(module);
  TORCH_CHECK(!sparse, where, "'", *sparse, "' is an Embedding with sparse(true), whose gradient is sparse, and "
              "deterministic mode sums dense gradients only. Construct it with sparse(false).");
}

void write_fixed_point(torch::Tensor& sum, const std::vector<FixedPointPiece>& pieces,
                       const MicroBatchGradients& gradients) {
  int64_t covered = 0;
  for (const auto& piece : pieces) {
    covered += piece.count;
  }
  const bool zeroed = covered < sum.numel(); // else each piece's first term is written, not added
  if (zeroed) {
    sum.zero_();
  }
  for (const auto& piece : pieces) {
    const double largest = gradients.maxima[piece.param];
    auto part = sum.narrow(0, piece.at, piece.count);
    bool written = zeroed;
    if (std::isfinite(largest)) {
      const int exponent = fixed_point_exponent(largest, gradients.micro_batches);
      for (const auto& micro_batch : gradients.grads) {
        const auto& grad = micro_batch[piece.param];
        if (grad.defined()) {
          add_fixed_point(part, grad.narrow(0, piece.begin, piece.count), exponent, written);
          written = true;
        }
      }
    }
    if (!written) {
      part.zero_();
    }
  }
}

torch::Tensor read_fixed_point(const torch::Tensor& sum, const FixedPointPiece& piece,
                               const MicroBatchGradients& gradients, torch::ScalarType dtype, at::IntArrayRef sizes) {
  const double largest = gradients.maxima[piece.param];
  if (!std::isfinite(largest)) {
    return torch::full(sizes, std::numeric_limits<double>::quiet_NaN(), sum.options().dtype(dtype));
  }
  return from_fixed_point(sum.narrow(0, piece.at, piece.count), fixed_point_exponent(largest, gradients.micro_batches),
                          gradients.micro_batches, dtype, sizes);
}

void read_fixed_point_into(torch::Tensor out, const torch::Tensor& sum, const FixedPointPiece& piece,
                           const MicroBatchGradients& gradients) {
  const double largest = gradients.maxima[piece.param];
  if (!std::isfinite(largest)) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
    return;
  }
  const int exponent = fixed_point_exponent(largest, gradients.micro_batches);
  from_fixed_point_into(out, sum.narrow(0, piece.at, piece.count), exponent, gradients.micro_batches);
}

void check_no_micro_batch_options(const MicroBatchConfig& config, const std::string& where, const char* options) {
  TORCH_CHECK(config.micro_batches == 0 && config.micro_batch_size == 0 && config.seed == 0, where, options, "() "
              "sets micro_batches(", config.micro_batches, "), micro_batch_size(", config.micro_batch_size, ") or seed(",
              config.seed, ") without deterministic(true): only deterministic mode splits the batch into micro-batches "
              "and seeds them, so they would change nothing. Add deterministic(true), or leave them unset.");
}

MicroBatchStep::MicroBatchStep(torch::nn::Module& module, ProcessGroup group, const MicroBatchConfig& config,
                               torch::Device device, std::string where)
    : group_(std::move(group)),
      where_(std::move(where)),
      norms_(module, where_),
      config_(config),
      device_(device),
      plan_("deterministic mode's collectives of a step (" + where_.substr(0, where_.find(" (")) + ")",
            "They follow from the model's parameters and buffers, BatchNorm layers, micro_batches(V) and the "
            "world size: look for one of these that differs between ranks.") {
  const int64_t v = config_.micro_batches;
  TORCH_CHECK(v > 0, where_, "deterministic(true) needs micro_batches(V), the number of micro-batches in a step's "
              "global batch, but got ", v, ". Set it to the same V at every world size.");
  TORCH_CHECK(v % group_.size() == 0, where_, "micro_batches(", v, ") is not a multiple of the world size ",
              group_.size(), ": every rank runs V/W micro-batches of a step. Run at a world size that divides ", v,
              ", or choose a V that ", group_.size(), " divides.");
  TORCH_CHECK(config_.micro_batch_size >= 0, where_, "micro_batch_size must be >= 0 (0 checks nothing), but got ",
              config_.micro_batch_size, ".");
  TORCH_CHECK(group_.supports(Collective::Allreduce, torch::kLong, device_), where_, "the ", group_.backend(),
              " backend cannot allreduce int64 tensors on ", device_, ", which deterministic(true) sums the gradients "
              "in. Use gloo, mpi or nccl.");
  check_exactly_summable(module, where_, /*frozen_too=*/false);
  for (const auto& b : module.named_buffers()) {
    buffers_.emplace_back(b.key(), b.value());
    if (!norms_.tracks(b.value())) {
      watched_.push_back({"buffer '" + b.key() + "'", b.value(), static_cast<int64_t>(buffers_.size() - 1)});
    }
  }
  const auto params = module.named_parameters();
  for (size_t i : first_occurrences(params.values())) {
    if (!params[i].value().requires_grad()) {
      watched_.push_back({"frozen parameter '" + params[i].key() + "'", params[i].value(), -1});
    }
  }
  if (device_.is_cuda()) {
    // Note [The same bits at any world size]: a GPU kernel may add in an
    // order of its own (atomics), so the process asks for deterministic
    // ones, and an operator without one is PyTorch's error naming it. cuBLAS
    // reads its workspace setting when it first starts.
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    // cuDNN's benchmark mode times the deterministic algorithms too and takes
    // the fastest, which may differ between processes, and so would the bits.
    at::globalContext().setBenchmarkCuDNN(false);
  }
}

void MicroBatchStep::check_forward(int64_t batch) const {
  if (running_ < 0) {
    TORCH_CHECK(!torch::GradMode::is_enabled(), where_, "a forward with autograd on ran outside "
                "backward_micro_batches(step, loss_of). In deterministic mode, gradients come only from there, where "
                "each micro-batch runs alone and the ranks sum them exactly. Call forward inside loss_of, or under "
                "torch::NoGradGuard to evaluate.");
    return;
  }
  const int64_t size = config_.micro_batch_size;
  TORCH_CHECK(size == 0 || batch == size, where_, "micro-batch ", running_, "'s forward got a batch of ",
              batch < 0 ? std::string("no tensor") : std::to_string(batch), " (the first tensor argument's size in "
              "dim 0), but micro_batch_size is ", size, ". Every micro-batch must have micro_batch_size samples, at "
              "every world size: the sum of their gradients over V is then the mean over the global batch.");
}

MicroBatchGradients MicroBatchStep::run(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of,
                                        const std::function<std::vector<torch::Tensor>()>& take) {
  TORCH_CHECK(step >= 0, where_, "step must be >= 0, but got ", step, ".");
  TORCH_CHECK(running_ < 0, where_, "backward_micro_batches was called from inside its own loss_of.");
  TORCH_CHECK(torch::GradMode::is_enabled(), where_, "backward_micro_batches needs autograd on, but it ran under "
              "torch::NoGradGuard.");
  const int64_t share = config_.micro_batches / group_.size();
  const int64_t first = group_.rank() * share;
  MicroBatchGradients gradients;
  gradients.micro_batches = config_.micro_batches;
  Report report;
  for (const auto& buffer : buffers_) {
    report.buffer_hashes.push_back(hash_of(buffer.second));
  }
  std::vector<uint32_t> versions;
  for (const auto& w : watched_) {
    versions.push_back(w.tensor._version());
  }
  const size_t count = take().size(); // each micro-batch's gradient alone
  norms_.start_step();
  RestoreUnlessTaken restore{norms_};
  std::exception_ptr failure;
  for (int64_t k = 0; k < share && !failure; ++k) {
    const int64_t v = first + k;
    try {
      timeline::Span span([v] { return "micro-batch " + std::to_string(v); });
      SeededGenerators seeded(device_, micro_batch_seed(config_.seed, step, v));
      norms_.begin();
      running_ = v;
      torch::Tensor loss = loss_of(v);
      check_loss(loss, v);
      loss.backward();
      running_ = -1;
      norms_.end(k);
      report.losses.push_back(loss.item<double>());
      auto grads = take();
      for (auto& grad : grads) {
        grad = grad.defined() ? grad.reshape({-1}) : grad;
      }
      gradients.grads.push_back(std::move(grads));
    } catch (...) { // Note [A micro-batch's error on every rank]
      running_ = -1;
      failure = std::current_exception();
      report.failed_at = v;
      take();
    }
  }
  report.losses.resize(static_cast<size_t>(share), 0.0);
  report.changed = failure ? -1 : first_changed(versions, report.buffer_hashes);
  gather(step, gradients, count, report, failure);
  restore.taken = true;
  return gradients;
}

// Note [A micro-batch's error on every rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A micro-batch's error (a batch of the wrong size, a loss that is not one,
// a BatchNorm run twice, the user's own) may hit one rank only: the last
// micro-batch of a short epoch lands on one. Thrown there at once, it would
// leave the other ranks in the step's all_gather until the group's timeout.
// So the rank stops running micro-batches, joins the all_gather with the
// failed micro-batch's index in its report, and every rank then throws: the
// failed rank its own error, the others one naming that rank and
// micro-batch. The running statistics go back to the step's start.

void MicroBatchStep::check_loss(const torch::Tensor& loss, int64_t v) const {
  TORCH_CHECK(loss.defined() && loss.numel() == 1 && at::isFloatingType(loss.scalar_type()) && loss.requires_grad(),
              where_, "loss_of(", v, ") must return the micro-batch's loss: one floating-point element that "
              "requires a gradient, but it returned ", loss.defined() ? loss.toString() + " of " +
              std::to_string(loss.numel()) + " elements" + (loss.requires_grad() ? "" : " without a gradient")
              : std::string("an undefined tensor"), ".");
}

// The first of watched_ that the step's micro-batches changed, -1 if none:
// its version counter moved and, for a buffer, its bytes too (a forward may
// rewrite a buffer with the values it held).
int64_t MicroBatchStep::first_changed(const std::vector<uint32_t>& versions,
                                      const std::vector<double>& buffer_hashes) const {
  for (size_t i = 0; i < watched_.size(); ++i) {
    const auto& w = watched_[i];
    if (w.tensor._version() != versions[i] &&
        (w.buffer < 0 || !same_bits(hash_of(w.tensor), buffer_hashes[static_cast<size_t>(w.buffer)]))) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

void MicroBatchStep::gather(int64_t step, MicroBatchGradients& gradients, size_t count, const Report& report,
                            const std::exception_ptr& failure) {
  timeline::Span span("deterministic: maxima, losses and buffers");
  const size_t share = report.losses.size();
  std::vector<double> mine;
  for (size_t p = 0; p < count; ++p) {
    double largest = -1; // no gradient in this rank's micro-batches
    for (const auto& micro_batch : gradients.grads) {
      if (micro_batch[p].defined()) {
        largest = max_of(largest, max_abs(micro_batch[p]));
      }
    }
    mine.push_back(largest);
  }
  mine.insert(mine.end(), report.losses.begin(), report.losses.end());
  mine.insert(mine.end(), report.buffer_hashes.begin(), report.buffer_hashes.end());
  const auto records = norms_.recorded(static_cast<int64_t>(share));
  mine.insert(mine.end(), records.begin(), records.end());
  const size_t changed_at = mine.size();
  mine.push_back(static_cast<double>(report.changed));
  mine.push_back(static_cast<double>(report.failed_at));
  mine.push_back(static_cast<double>(step));
  auto local = torch::tensor(mine, torch::kDouble).to(device_);
  if (group_.size() > 1) {
    plan_.start_iteration(group_, device_); // Note [A step's planned collectives]
  }
  const auto item =
      next_collective({local.numel(), local.scalar_type(), fingerprint::kAllGather, current_collective_tag()});
  PlannedCollective planned(item.first, item.second);
  auto all = torch::empty({group_.size() * local.numel()}, local.options());
  group_.all_gather_into_async(all, local, "step " + std::to_string(step) + "'s largest gradients, losses and "
                               "buffers (deterministic mode)")->wait();
  std::vector<torch::Tensor> on_cpu;
  std::vector<const double*> reports;
  for (const auto& theirs : all.chunk(group_.size())) {
    on_cpu.push_back(theirs.cpu());
    reports.push_back(on_cpu.back().data_ptr<double>());
  }
  check_no_failure(step, reports, changed_at, failure);
  for (size_t r = 0; r < reports.size(); ++r) {
    check_same_as_rank0(r, reports[r], reports[0], count + share, mine.size() - 1);
  }
  combine(gradients, reports, count, share);
}

// Every rank's maxima (-1 where it had no gradient), losses and BatchNorm
// updates, in rank order, as one step's.
void MicroBatchStep::combine(MicroBatchGradients& gradients, const std::vector<const double*>& reports, size_t count,
                             size_t share) {
  gradients.maxima.assign(count, -1);
  double loss_sum = 0; // in micro-batch order: rank 0's share first
  std::vector<const double*> norm_records;
  for (const double* data : reports) {
    norm_records.push_back(data + count + share + buffers_.size());
    for (size_t p = 0; p < count; ++p) {
      gradients.maxima[p] = max_of(gradients.maxima[p], data[p]);
    }
    for (size_t k = 0; k < share; ++k) {
      loss_sum += data[count + k];
    }
  }
  gradients.used.assign(count, 0);
  for (size_t p = 0; p < count; ++p) {
    gradients.used[p] = !(gradients.maxima[p] < 0); // NaN was used
    gradients.maxima[p] = gradients.used[p] ? gradients.maxima[p] : 0.0;
  }
  gradients.mean_loss = loss_sum / static_cast<double>(config_.micro_batches);
  norms_.replay(norm_records, static_cast<int64_t>(share));
}

// Every rank's report of a failed micro-batch or a watched tensor changed
// (at `at` in each, the failed micro-batch after it): an error on every
// rank, the same but for the failed rank's own.
void MicroBatchStep::check_no_failure(int64_t step, const std::vector<const double*>& reports, size_t at,
                                      const std::exception_ptr& failure) const {
  int64_t failed_rank = -1;
  for (size_t r = 0; r < reports.size() && failed_rank < 0; ++r) {
    failed_rank = reports[r][at + 1] >= 0 ? static_cast<int64_t>(r) : -1;
  }
  if (failed_rank >= 0) {
    if (failure) {
      std::rethrow_exception(failure);
    }
    TORCH_CHECK(false, where_, "rank ", failed_rank, " failed in micro-batch ",
                static_cast<int64_t>(reports[failed_rank][at + 1]), " of step ", step, "; its own error says why. "
                "Every rank stops at this step.");
  }
  for (size_t r = 0; r < reports.size(); ++r) {
    const auto changed = static_cast<int64_t>(reports[r][at]);
    if (changed >= 0) {
      TORCH_CHECK(false, where_, "step ", step, "'s micro-batches changed ", watched_[changed].name, " on rank ", r,
                  ". What forward changes depends on how many micro-batches each rank runs, so deterministic mode "
                  "cannot keep it the same at every world size; only BatchNorm's running statistics are kept "
                  "exact. Keep it constant in forward (fill a cache once, before the first step, under "
                  "torch::NoGradGuard), make it a trained parameter, or update it outside backward_micro_batches.");
    }
  }
}

// Rank r's step number (at `step_at` in the gathered values) and buffers'
// hashes (from `buffers_at`) against rank 0's: the same text on every rank.
void MicroBatchStep::check_same_as_rank0(size_t r, const double* theirs, const double* rank0, size_t buffers_at,
                                         size_t step_at) const {
  const auto step = static_cast<int64_t>(rank0[step_at]);
  TORCH_CHECK(theirs[step_at] == rank0[step_at], where_, "rank 0 runs backward_micro_batches(", step, ") but rank ",
              r, " runs backward_micro_batches(", static_cast<int64_t>(theirs[step_at]), "). Each micro-batch draws "
              "its randomness from a generator seeded by the step and its index, so ranks at other step numbers "
              "would not give one rank's bits. Pass every rank the same step: the number of optimizer steps so far.");
  for (size_t b = 0; b < buffers_.size(); ++b) {
    TORCH_CHECK(same_bits(theirs[buffers_at + b], rank0[buffers_at + b]), where_, "as step ", step, " starts, "
                "buffer '", buffers_[b].first, "' differs between rank 0 and rank ", r, ". A buffer that forward "
                "changes (other than BatchNorm's statistics) depends on which micro-batches each rank ran, so "
                "deterministic mode cannot keep it the same at every world size. Make it a parameter, or keep it "
                "constant during training.");
  }
}

// Note [A step's planned collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A deterministic step sends the same collectives every time, of the same
// sizes: the all_gather of the maxima, losses and buffers, then the int64
// reduce-scatter, and under DistributedDataParallel the all_gather of the
// gradients. So they go as a recurring plan (Note [Recurring plans]): the
// first step's are checked and recorded, the next step agrees on that record
// once, and from then on each goes without the agreement's round trip
// before it, its words carried by the ring (Note [Planned rings]) where the
// backend does that (Gloo, on the CPU); elsewhere, and under
// LOCKSTEP_DEBUG=detail, each keeps its check. A rank at a step while
// another is at a checked collective pairs with nothing, and both fail at
// the group's timeout naming their collectives (Note [Planned collectives]);
// so do two models' steps run in another order (Note [A switch of plans is
// checked]). The int64 allreduce that some steps take instead of the
// reduce-scatter stays checked: a planned allreduce carries its words in
// floating-point elements of its tensor.
std::pair<int64_t, int64_t> MicroBatchStep::next_collective(const PlanItem& item) {
  return group_.size() > 1 ? plan_.next(item) : std::make_pair(int64_t{-1}, int64_t{0});
}

} // namespace detail
} // namespace lockstep
