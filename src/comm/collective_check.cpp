#include "comm/collective_check.h"

#include "comm/forwarding_group.h"
#include "comm/forwarding_work.h"
#include "comm/planned_collective.h"
#include "util/caller_stream.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace lockstep {
namespace detail {

// Note [Ranks agree before they send]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Ranks that call collectives of different sizes at the same point (a
// rank-dependent branch, DistributedOptions that differ between ranks, so
// buckets that differ) must end with an error on every rank, and no rank may
// die of it. Gloo does not allow that: a message longer than the receiver
// expects fails an assertion in Gloo's own network thread
// ("op.preamble.length <= op.nbytes ... collective mismatch?"), where
// nothing can catch it, and the process aborts. MPI and NCCL read past the
// buffer, or wait for good. So no rank may send a collective before it knows
// that every rank sends the same one.
//
// Before each collective, every rank all_gathers a fingerprint of a few
// integers (operation, reduction or root, dtype, element count, a tag, and
// the number and shapes of the caller's tensors: Note [The caller's
// collective]) and compares them: when they differ, every rank sees the
// same difference and throws it from wait(), naming rank 0's and the first
// differing rank's collective, and none sends it. Fingerprints have one
// size, so a rank's check can only meet another rank's check, and the ranks
// stay paired for what follows.
//
// The check must complete before the collective starts, but the caller must
// not wait for it (DDP starts a bucket's allreduce from inside backward). So
// each group has a thread that takes the collectives in the order they were
// started, checks each, then starts it in the backend and goes on to the
// next, without waiting for it to finish. The order, which every rank shares,
// is kept, and collectives still overlap with each other and with backward.
// The cost is one small all_gather per collective, off the caller's thread:
// it delays each collective's start by a round trip (docs/performance.md).
// DistributedDataParallel's buckets, PowerSGD's allreduces and
// FullyShardedDataParallel's backward avoid it over Gloo (and DDP's and
// PowerSGD's over MPI between ranks of one host): their plan is
// agreed once, and each carries words checked after it completes instead
// (Note [Planned collectives] and Note [Planned rings] in
// src/comm/planned_collective.cpp); with nothing queued before it, such a
// collective starts on the caller's thread.
// Over NCCL the collective is started from this thread, so it waits for that
// thread's current CUDA stream, the device's default one; a barrier is not
// checked there, having no CUDA tensor to check with (NCCL's own watchdog
// catches a barrier that some rank never joins).

using namespace fingerprint; // the check's own vocabulary: Kind, Field, Fingerprint

namespace {

// Note [A group whose collective failed]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A check's all_gather, or a collective, that fails or times out leaves the
// ranks unpaired: some sent it and some did not, or a peer is stuck. What
// is queued behind it must not be sent into that group: on a backend that
// keeps its connections after a timeout, each would wait for the same peer
// in turn, a timeout each (and the destructor, which drains the queue, as
// long); on Gloo, which closes them, each failed with an error of its own
// that did not say the first one was the cause. So the first such failure
// breaks the group: every collective not yet checked fails at once, naming
// it. A disagreement (the ranks' checks met and differ) or a refusal on
// this rank before sending leaves the ranks paired, and the group goes on.
class Broken {
 public:
  void record(const std::string& what, const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_.empty()) {
      first_ = what + ": " + (error != nullptr ? error->what_without_backtrace() : e.what());
    }
  }
  std::string first() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return first_;
  }

 private:
  mutable std::mutex mutex_;
  std::string first_; // the first failure: what, then its error
};

// One collective: its check, then its start, both by the group's thread.
struct Job {
  Fingerprint fingerprint{};
  torch::Device device = torch::kCPU;
  c10::optional<c10::Stream> stream; // Note [The caller's stream]
  std::string what;
  std::function<std::shared_ptr<Work>(const std::string& what)> start;
  // Note [Planned collectives]: where this collective carries its words,
  // sent without the check before it; undefined for a checked one.
  torch::Tensor words;
  bool words_read = false; // once: a later wait() may find them divided (Avg) or written over
  std::string words_error;
  int rank = 0, size = 1;
  std::mutex mutex;
  std::condition_variable changed;
  bool taken = false; // the group's thread has begun it
  bool done = false; // checked and started, or failed
  std::shared_ptr<Work> work; // the backend's
  std::exception_ptr error;
  std::shared_ptr<Broken> broken; // the group's
};

class QueuedWork : public Work {
 public:
  explicit QueuedWork(std::shared_ptr<Job> job) : job_(std::move(job)) {}
  void wait() override {
    std::shared_ptr<Work> work;
    {
      std::unique_lock<std::mutex> lock(job_->mutex);
      job_->changed.wait(lock, [&] { return job_->done; }); // bounded: the check's own wait has the timeout
      if (job_->error) {
        std::rethrow_exception(job_->error);
      }
      work = job_->work;
    }
    try {
      work->wait();
    } catch (const std::exception& e) {
      job_->broken->record(job_->what, e); // Note [A group whose collective failed]
      throw;
    }
    if (job_->words.defined()) { // Note [Planned collectives]
      std::string error;
      {
        std::lock_guard<std::mutex> lock(job_->mutex);
        if (!job_->words_read) {
          job_->words_error = plan_words_disagreement(job_->words, job_->size);
          job_->words_read = true;
        }
        error = job_->words_error;
      }
      TORCH_CHECK(error.empty(), "lockstep: rank ", job_->rank, " of ", job_->size, ": ", job_->what, ": ", error);
    }
  }
  bool started() const override {
    std::lock_guard<std::mutex> lock(job_->mutex);
    return job_->taken && (job_->work == nullptr || job_->work->started());
  }

 private:
  std::shared_ptr<Job> job_;
};

// An all_gather's Work that puts the results into the caller's tensors: a
// GroupImpl may fill `outputs` by assigning new tensors to its elements
// (one that forwards to another ProcessGroup does), and the caller's vector
// is not the one that the group's thread hands to the backend.
class GatheredWork : public ForwardingWork {
 public:
  GatheredWork(std::shared_ptr<Work> work, std::shared_ptr<std::vector<torch::Tensor>> gathered,
               std::vector<torch::Tensor> targets)
      : ForwardingWork(std::move(work)), gathered_(std::move(gathered)), targets_(std::move(targets)) {}
  void wait() override {
    inner_->wait();
    for (size_t r = 0; r < targets_.size() && r < gathered_->size(); ++r) {
      if (!(*gathered_)[r].is_same(targets_[r])) {
        targets_[r].copy_((*gathered_)[r]);
      }
    }
    targets_.clear(); // copied once
  }

 private:
  std::shared_ptr<std::vector<torch::Tensor>> gathered_;
  std::vector<torch::Tensor> targets_;
};

class CheckedGroup : public ForwardingGroup {
 public:
  CheckedGroup(std::shared_ptr<GroupImpl> inner, bool detail)
      : ForwardingGroup(std::move(inner)), detail_(detail), thread_([this] { loop(); }) {}
  ~CheckedGroup() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    queued_.notify_all();
    thread_.join();
  }

  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    return enqueue(kAllreduce, static_cast<int64_t>(op), tensors, std::move(what),
                   [inner = inner_, tensors, op](const std::string& w) mutable { return inner->allreduce(tensors, op, w); });
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    return enqueue(kBroadcast, root, tensors, std::move(what),
                   [inner = inner_, tensors, root](const std::string& w) mutable { return inner->broadcast(tensors, root, w); });
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) override {
    auto words = planned_ring_words(input);
    return enqueue(kAllGather, 0, {input}, std::move(what),
                   [inner = inner_, rings = rings_, targets = outputs, input,
                    words](const std::string& w) mutable -> std::shared_ptr<Work> {
                     auto gathered = std::make_shared<std::vector<torch::Tensor>>(targets);
                     auto work = words.defined() ? rings->planned_all_gather(*gathered, input, w, words)
                                                 : inner->all_gather(*gathered, input, w);
                     return std::make_shared<GatheredWork>(std::move(work), std::move(gathered), targets);
                   },
                   words);
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what) override {
    auto words = planned_ring_words(input);
    return enqueue(kReduceScatter, static_cast<int64_t>(op), {input}, std::move(what),
                   [inner = inner_, rings = rings_, output, input, op, words](const std::string& w) mutable {
                     return words.defined() ? rings->planned_reduce_scatter(output, input, op, w, words)
                                            : inner->reduce_scatter(output, input, op, w);
                   },
                   words);
  }
  std::shared_ptr<Work> barrier(std::string what) override {
    return enqueue(kBarrier, 0, {}, std::move(what), [inner = inner_](const std::string& w) { return inner->barrier(w); });
  }

 private:
  // `tensors`: those the backend gets, which the fingerprint describes.
  // `ring_words`: a planned all-gather's or reduce-scatter's (planned_ring_words).
  std::shared_ptr<Work> enqueue(Kind kind, int64_t arg, const std::vector<torch::Tensor>& tensors, std::string what,
                                std::function<std::shared_ptr<Work>(const std::string&)> start,
                                torch::Tensor ring_words = {}) {
    auto job = std::make_shared<Job>();
    job->broken = broken_;
    job->fingerprint = fingerprint_of(kind, arg, tensors);
    job->device = tensors.empty() ? torch::Device(torch::kCPU) : tensors[0].device();
    job->stream = caller_stream(job->device);
    job->what = std::move(what);
    job->start = std::move(start);
    job->words = ring_words.defined() ? std::move(ring_words) : planned_words(kind, arg, tensors);
    job->rank = rank();
    job->size = size();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const int64_t seq = next_seq_++; // numbered in the order the queue, and so every rank, sends them
      if (detail_) {
        add_detail(job->fingerprint, seq, tensors);
      }
      if (job->words.defined()) {
        PlanWords words = current_plan_words();
        words.seq = seq;
        write_plan_words(job->words, job->rank, job->size, words,
                         kind == kAllreduce && arg == static_cast<int64_t>(ReduceOp::Avg));
        if (queue_.empty() && !busy_) {
          run(*job); // nothing to check first, nor to wait for: started here, in order, without a thread hop
          return std::make_shared<QueuedWork>(std::move(job));
        }
      }
      queue_.push_back(job);
    }
    queued_.notify_one();
    return std::make_shared<QueuedWork>(std::move(job));
  }

  // Note [Planned collectives]: the room for the words at the end of a
  // planned allreduce's tensor, where it goes without the check; otherwise
  // undefined, with the room zeroed (its sum is not read).
  torch::Tensor planned_words(Kind kind, int64_t arg, const std::vector<torch::Tensor>& tensors) {
    const int64_t room = plan_words_elements(size());
    // An Avg reaches here only where the backend averages (GroupImpl::averages).
    const bool adds = arg == static_cast<int64_t>(ReduceOp::Sum) || arg == static_cast<int64_t>(ReduceOp::Avg);
    if (current_plan_words().plan < 0 || kind != kAllreduce || !adds || tensors.size() != 1 || room == 0) {
      return {};
    }
    const auto& t = tensors[0];
    TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.numel() >= room && at::isFloatingType(t.scalar_type()),
                          "a planned collective without room for its words");
    auto words = t.view(-1).narrow(0, t.numel() - room, room);
    if (detail_ || !inner_->pairs_collectives_by_kind(t.device()) || switches_plan()) {
      words.zero_();
      return {};
    }
    return words;
  }

  // Note [A switch of plans is checked]: whether this thread's planned
  // collective belongs to another plan than the group's last one; it is then
  // the group's last.
  bool switches_plan() {
    const int64_t plan = current_plan_words().plan;
    return last_plan_.exchange(plan) != plan;
  }

  // Note [Planned rings]: where this thread's collective is a plan's item and
  // the backend carries the words of an all-gather or reduce-scatter, their
  // room (every rank's slot, zeros until written); otherwise undefined. An
  // empty collective sends nothing to carry them in.
  torch::Tensor planned_ring_words(const torch::Tensor& input) {
    const int64_t room = plan_words_elements(size());
    if (current_plan_words().plan < 0 || room == 0 || input.numel() == 0 || detail_ || !rings_ ||
        !rings_->carries_plan_words(input.device()) || switches_plan()) {
      return {};
    }
    return torch::zeros({room}, torch::kDouble);
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) {
        return; // stop_, with nothing left to start
      }
      auto job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      run(*job);
      lock.lock();
      busy_ = false;
    }
  }

  void run(Job& job) {
    {
      std::lock_guard<std::mutex> lock(job.mutex);
      job.taken = true;
    }
    std::shared_ptr<Work> work;
    std::exception_ptr error;
    try {
      const std::string broken = broken_->first(); // Note [A group whose collective failed]
      TORCH_CHECK(broken.empty(), "lockstep: rank ", rank(), " of ", size(), ": ", job.what, " was not sent: an "
                  "earlier collective of this group failed, so its ranks can no longer be kept in step. Let the "
                  "error end the job (a launcher restarts it from the last checkpoint), or make a new group on every "
                  "rank. The first failure: ", broken);
      if (!job.words.defined()) {
        // On this thread's streams, not the caller's: on a GPU, a caller on a
        // stream of its own (not the default) would otherwise have the
        // check's copies between host and device wait for all it queued.
        agree(job);
      }
      c10::OptionalStreamGuard on(job.stream); // Note [The caller's stream]
      work = job.start(job.what);
    } catch (...) {
      error = std::current_exception();
    }
    // What it holds (the backend's group among it) must not outlive the
    // start: a Work the caller keeps would keep the group alive, and MPI's
    // one group per process could not be made anew.
    job.start = nullptr;
    {
      std::lock_guard<std::mutex> lock(job.mutex);
      job.work = std::move(work);
      job.error = error;
      job.done = true;
    }
    job.changed.notify_all();
  }

  // Note [Ranks agree before they send].
  void agree(const Job& job) {
    if (!inner_->supports(Collective::AllGather, torch::kLong, job.device)) {
      return; // NCCL's barrier: no CUDA tensor to check with
    }
    const auto& f = job.fingerprint;
    auto mine = torch::tensor(std::vector<int64_t>(f.begin(), f.end()), torch::kLong).to(job.device);
    static_assert(sizeof(Fingerprint) == kFields * sizeof(int64_t), "one size on every rank");
    std::vector<torch::Tensor> all;
    for (int r = 0; r < size(); ++r) {
      all.push_back(torch::empty_like(mine));
    }
    try {
      inner_->all_gather(all, mine, job.what)->wait();
    } catch (const std::exception& e) {
      broken_->record(job.what, e);
      throw;
    }
    const auto reference = all[0].cpu();
    for (int r = 1; r < size(); ++r) {
      const auto theirs = all[r].cpu();
      TORCH_CHECK(torch::equal(theirs, reference), "lockstep: rank ", rank(), " of ", size(), ": ", job.what, ": ",
                  disagreement(reference.data_ptr<int64_t>(), theirs.data_ptr<int64_t>(), r));
    }
  }

  const bool detail_; // Note [LOCKSTEP_DEBUG=detail]
  // The backend, where its rings carry planned words (Note [Planned rings]).
  const std::shared_ptr<CarriesPlanWords> rings_ = std::dynamic_pointer_cast<CarriesPlanWords>(inner_);
  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::shared_ptr<Job>> queue_;
  int64_t next_seq_ = 0; // the next collective's number
  std::atomic<int64_t> last_plan_{-1}; // Note [A switch of plans is checked]
  bool busy_ = false; // the thread is checking or starting a collective it took from the queue
  bool stop_ = false;
  std::shared_ptr<Broken> broken_ = std::make_shared<Broken>();
  std::thread thread_; // last: started once the rest exists
};

bool debug_detail() {
  const char* text = std::getenv("LOCKSTEP_DEBUG");
  if (text == nullptr || *text == '\0' || std::string(text) == "off") {
    return false;
  }
  TORCH_CHECK(std::string(text) == "detail", "lockstep: environment variable LOCKSTEP_DEBUG=\"", text,
              "\" is not a setting; expected detail (the agreement check also numbers the collectives and compares "
              "their shapes: Note [LOCKSTEP_DEBUG=detail] in src/comm/collective_fingerprint.cpp) or off.");
  return true;
}

} // namespace

std::shared_ptr<GroupImpl> checked(std::shared_ptr<GroupImpl> impl) {
  const bool detail = debug_detail(); // read, and a wrong value refused, for a group of one too
  if (impl->size() == 1) {
    return impl;
  }
  return std::make_shared<CheckedGroup>(std::move(impl), detail);
}

} // namespace detail
} // namespace lockstep
