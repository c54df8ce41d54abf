// Compiled when the build found an MPI library (Open MPI from Debian's
// libopenmpi-dev); no_mpi.cpp otherwise.

#include "comm/backends/backends.h"
#include "comm/backends/mpi_library.h"
#include "comm/backends/shared_memory_collectives.h"
#include "comm/before_abort.h"

#include <lockstep/detail/collective_errors.h>

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace lockstep {
namespace detail {
namespace {

// Note [MPI's thread and timeouts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every MPI call of a group runs on that group's one communication thread, in
// the order the collectives were started, which is the same on every rank.
// The caller only queues them, so buckets are reduced while backward goes on,
// as over Gloo. MPI is initialised with MPI_THREAD_SERIALIZED, the level this
// needs: calls come from more than one thread (initialisation and the
// communication thread), never at once.
//
// MPI has no timeout. A rank waiting on a collective that another rank never
// starts would wait for good. So Work::wait() waits at most the group's
// timeout; past it, it prints why (rank, collective, timeout) and brings the
// whole job down with MPI_Abort, so that no rank hangs. It cannot throw and
// let the program go on: its communication thread is still inside MPI, and
// the next collective, or MPI_Finalize at exit, would hang. A rank that exits
// without MPI_Finalize makes mpirun end the others.
//
// While it waits inside a collective, Open MPI's shared-memory transport
// polls without pause. That thread is one Open MPI does not count: on a
// machine with no core to spare (2 ranks on 2 cores) its polling took the
// core that the rank's own compute, or the other rank's, was waiting for,
// and a sharded model's step, whose gathers run beside forward, lost up to
// a quarter (docs/performance.md). So when lockstep initialises MPI, it asks
// Open MPI to yield while idle, as Open MPI does by itself when
// oversubscribed, unless the environment already says
// (OMPI_MCA_mpi_yield_when_idle=0 restores polling). Other MPI libraries
// ignore the variable.

// Runs a collective through shared memory, for the communication thread:
// its error's text, or empty.
std::string through_shared_memory(const std::function<void()>& collective) {
  try {
    collective();
    return {};
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

// One queued collective: done (or failed) once the communication thread ran it.
struct Pending {
  std::mutex mutex;
  std::condition_variable changed;
  std::atomic<bool> started{false}; // the communication thread has taken it from the queue
  bool done = false;
  std::atomic<bool> finished{false}; // done, for a wait that polls
  std::string error; // non-empty: MPI reported one
};

class MpiWork : public Work {
 public:
  MpiWork(std::shared_ptr<Pending> pending, std::string what, int rank, int size, std::chrono::milliseconds timeout,
          std::chrono::microseconds spin, std::function<void()> finish)
      : pending_(std::move(pending)),
        what_(std::move(what)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        spin_(spin),
        finish_(std::move(finish)) {}

  bool started() const override {
    return pending_->started;
  }

  void wait() override {
    poll_for(spin_, [&] { return pending_->finished.load(std::memory_order_acquire); });
    std::unique_lock<std::mutex> lock(pending_->mutex);
    if (!pending_->changed.wait_for(lock, timeout_, [&] { return pending_->done; })) {
      // See Note [MPI's thread and timeouts].
      begin_mpi_abort();
      std::fprintf(stderr,
                   "lockstep: rank %d of %d: %s did not complete within the group's timeout of %lld ms. Another "
                   "rank may have stopped, crashed or be stuck elsewhere; its own error says why. Ending the whole "
                   "MPI job (MPI_Abort) so that no rank hangs.\n",
                   rank_, size_, what_.c_str(), static_cast<long long>(timeout_.count()));
      std::fflush(stderr);
      before_abort(what_ + " did not complete within the group's timeout"); // the flight recorder's dump
      MPI_Abort(MPI_COMM_WORLD, 1);
      std::_Exit(1);
    }
    if (!pending_->error.empty()) {
      throw_collective_error(what_, rank_, size_, timeout_, pending_->error);
    }
    if (finish_) {
      finish_();
      finish_ = nullptr;
    }
  }

 private:
  std::shared_ptr<Pending> pending_;
  std::string what_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_; // Note [Polling before a wait]
  std::function<void()> finish_;
};

// One MpiGroup alive per process: each has a communication thread that
// calls MPI, and under MPI_THREAD_SERIALIZED two threads must never be in
// MPI at once; two groups' threads would be, whenever their collectives
// overlap (undefined behaviour in Open MPI: crashes, hangs, wrong data).
class TheProcessGroup {
 public:
  TheProcessGroup() {
    bool free = false;
    TORCH_CHECK(taken().compare_exchange_strong(free, true), "lockstep: the mpi backend takes one group per process "
                "at a time, and one is alive: its communication thread calls MPI under MPI_THREAD_SERIALIZED, and a "
                "second group's would call it at the same moment. Run every collective over the live group, or "
                "destroy it before making another.");
  }
  ~TheProcessGroup() {
    taken() = false;
  }
  TheProcessGroup(const TheProcessGroup&) = delete;
  TheProcessGroup& operator=(const TheProcessGroup&) = delete;

 private:
  static std::atomic<bool>& taken() {
    static std::atomic<bool> flag{false};
    return flag;
  }
};

class MpiGroup : public GroupImpl {
 public:
  MpiGroup(std::chrono::milliseconds timeout, std::chrono::microseconds spin) : timeout_(timeout), spin_(spin) {
    init_mpi();
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm node;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
    int on_node = 0;
    MPI_Comm_size(node, &on_node);
    MPI_Comm_free(&node);
    one_node_ = on_node == size_;
    if (one_node_ && size_ > 1) { // Note [Collectives through shared memory]
      const char* env = std::getenv("LOCKSTEP_MPI_SHM");
      const bool willing = !(env != nullptr && std::string(env) == "0");
      shm_ = SharedMemoryCollectives::connect(
          [this](const std::string&, const std::string& mine) { return all_gather_strings(comm_, size_, mine); },
          willing, rank_, size_, timeout_);
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~MpiGroup() override {
    if (shm_) {
      shm_->stop(); // the communication thread, joined below, may wait in one
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    queued_.notify_all();
    thread_.join();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !mpi_aborting()) {
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  std::string backend() const override {
    return "mpi";
  }
  std::chrono::milliseconds timeout() const override {
    return timeout_;
  }
  // Between ranks of one machine Open MPI goes through shared memory, where
  // a collective costs little beside its bytes; across machines each is a
  // network round trip.
  bool cheap_collective_starts() const override {
    return one_node_;
  }
  // Note [Planned collectives]: through shared memory, every collective's
  // header names its kind, as the Gloo group's do there. A planned allreduce
  // (Float or Double, the floating dtypes supports() lets through, summed)
  // always goes that way, and so does the check before every unplanned
  // collective (an all-gather of Long): a planned allreduce that meets
  // anything but another rank's allreduce of its size fails on both at once.
  // Between hosts MPI pairs collectives by their order alone.
  bool pairs_collectives_by_kind(torch::Device device) const override {
    return shm_ != nullptr && device.is_cpu();
  }
  bool averages(torch::ScalarType dtype, torch::Device device) const override {
    return SharedMemoryCollectives::averages(shm_.get(), dtype, device);
  }
  // The types mpi_type maps, on the CPU. MPI reduces MPI_C_BOOL only with
  // its logical operations, so bools are reduced as bytes (Note [One tensor
  // per collective] in src/comm/collective_args.cpp).
  bool supports(Collective op, torch::ScalarType dtype, torch::Device device) const override {
    if (!device.is_cpu()) {
      return false;
    }
    switch (dtype) {
      case torch::kFloat:
      case torch::kDouble:
      case torch::kInt:
      case torch::kLong:
      case torch::kShort:
      case torch::kChar:
      case torch::kByte:
        return true;
      case torch::kBool:
        return op != Collective::Allreduce && op != Collective::ReduceScatter;
      default:
        return false;
    }
  }

  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    auto flat = on_cpu(tensors, what);
    const MPI_Datatype type = mpi_type(flat, what, rank_);
    const int count = mpi_count(flat, what, rank_);
    std::function<void()> finish = [tensors, flat]() mutable { copy_back(flat, tensors); };
    if (shm_ && SharedMemoryCollectives::fits(flat, op)) { // Avg among them, where averages() says so
      return start(what, std::move(finish), [shm = shm_.get(), flat, op] {
        return through_shared_memory([&] { shm->allreduce(flat, op); });
      });
    }
    return start(what, std::move(finish), [this, flat, type, mpi = mpi_op(op), count] {
      return mpi_error(MPI_Allreduce(MPI_IN_PLACE, flat.data_ptr(), count, type, mpi, comm_));
    });
  }

  // Note [Buffers every rank can reach], made on the communication thread.
  std::vector<torch::Tensor> shared_buffers(const std::vector<int64_t>& bytes) override {
    if (!shm_) {
      return {};
    }
    auto made = std::make_shared<std::vector<torch::Tensor>>();
    start("the allocation of buffers in shared memory", [] {}, [shm = shm_.get(), bytes, made] {
      return through_shared_memory([&] { *made = shm->share(bytes); });
    })->wait();
    return *made;
  }

  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    auto flat = on_cpu(tensors, what);
    const MPI_Datatype type = mpi_type(flat, what, rank_);
    const int count = mpi_count(flat, what, rank_);
    std::function<void()> finish = [tensors, flat]() mutable { copy_back(flat, tensors); };
    if (shm_ && SharedMemoryCollectives::fits(flat)) {
      return start(what, std::move(finish), [shm = shm_.get(), flat, root] {
        return through_shared_memory([&] { shm->broadcast(flat, root); });
      });
    }
    return start(what, std::move(finish), [this, flat, type, root, count] {
      return mpi_error(MPI_Bcast(flat.data_ptr(), count, type, root, comm_));
    });
  }

  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) override {
    std::vector<torch::Tensor> inputs{input};
    auto in = on_cpu(inputs, what);
    const MPI_Datatype type = mpi_type(in, what, rank_);
    const int n = mpi_count(in, what, rank_);
    std::function<void()> finish;
    torch::Tensor out = adjacent(outputs, in);
    if (!out.defined()) {
      out = torch::empty({static_cast<int64_t>(size_) * in.numel()}, in.options());
      finish = [outputs, out, n = in.numel()]() mutable {
        for (size_t r = 0; r < outputs.size(); ++r) {
          outputs[r].copy_(out.narrow(0, static_cast<int64_t>(r) * n, n).view(outputs[r].sizes()));
        }
      };
    }
    // In place when the input is this rank's part of the output already.
    const bool in_place = in.data_ptr() == static_cast<char*>(out.data_ptr()) + rank_ * in.numel() * in.element_size();
    if (shm_ && SharedMemoryCollectives::fits(in)) {
      return start(what, std::move(finish), [shm = shm_.get(), in, out, size = size_] {
        return through_shared_memory([&] { shm->all_gather(out.view({size, -1}).unbind(0), in, {}); });
      });
    }
    return start(what, std::move(finish), [this, in, out, type, in_place, n] {
      return mpi_error(MPI_Allgather(in_place ? MPI_IN_PLACE : in.data_ptr(), n, type, out.data_ptr(), n, type, comm_));
    });
  }

  std::shared_ptr<Work> barrier(std::string what) override {
    return start(what, nullptr, [this] { return mpi_error(MPI_Barrier(comm_)); });
  }

  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what)
      override {
    std::vector<torch::Tensor> inputs{input};
    auto in = on_cpu(inputs, what);
    std::vector<torch::Tensor> outputs{output};
    auto out = on_cpu(outputs, what);
    const MPI_Datatype type = mpi_type(in, what, rank_);
    const int count = mpi_count(out, what, rank_);
    if (shm_ && SharedMemoryCollectives::fits(in, op) && SharedMemoryCollectives::fits(out, op)) {
      return start(what, nullptr, [shm = shm_.get(), in, out, op] {
        return through_shared_memory([&] { shm->reduce_scatter(out, in, op, {}); });
      });
    }
    return start(what, nullptr, [this, in, out, type, mpi = mpi_op(op), count] {
      return mpi_error(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), count, type, mpi, comm_));
    });
  }

 private:
  // The outputs as one flat tensor when they are consecutive, contiguous
  // parts of one buffer (all_gather_into's, a sharded model's gathers), so
  // that MPI receives straight into them; else undefined.
  torch::Tensor adjacent(const std::vector<torch::Tensor>& outputs, const torch::Tensor& in) const {
    const int64_t n = in.numel();
    if (static_cast<int>(outputs.size()) != size_ || n == 0) {
      return torch::Tensor();
    }
    const auto* first = static_cast<const char*>(outputs[0].data_ptr());
    for (size_t r = 0; r < outputs.size(); ++r) {
      const auto& out = outputs[r];
      if (!out.device().is_cpu() || !out.is_contiguous() || out.numel() != n || out.scalar_type() != in.scalar_type() ||
          static_cast<const char*>(out.data_ptr()) != first + static_cast<int64_t>(r) * n * in.element_size()) {
        return torch::Tensor();
      }
    }
    return torch::from_blob(outputs[0].data_ptr(), {size_ * n}, [keep = outputs](void*) {}, in.options());
  }

  // The tensors as one contiguous CPU tensor that MPI can read and write.
  torch::Tensor on_cpu(const std::vector<torch::Tensor>& tensors, const std::string& what) const {
    for (const auto& t : tensors) {
      TORCH_CHECK(t.device().is_cpu(), "lockstep: rank ", rank_, ": ", what, ": the mpi backend takes CPU tensors, but "
                  "this one is on ", t.device(), ". Use the nccl backend for CUDA tensors (\"auto\" picks it).");
    }
    if (tensors.size() == 1 && tensors[0].is_contiguous()) {
      return tensors[0];
    }
    std::vector<torch::Tensor> flat;
    for (const auto& t : tensors) {
      flat.push_back(t.reshape({-1}));
    }
    return torch::cat(flat);
  }

  static void copy_back(const torch::Tensor& flat, std::vector<torch::Tensor>& tensors) {
    if (tensors.size() == 1 && tensors[0].data_ptr() == flat.data_ptr()) {
      return;
    }
    int64_t offset = 0;
    for (auto& t : tensors) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }

  // `call` returns its error's text, or empty.
  std::shared_ptr<Work> start(std::string what, std::function<void()> finish, std::function<std::string()> call) {
    auto pending = std::make_shared<Pending>();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back([pending, call = timed_where_it_runs(std::move(call), what)]() mutable {
        pending->started = true;
        std::string error = std::exchange(call, nullptr)(); // its tensors released before it is done, as in gloo_rings.h
        std::lock_guard<std::mutex> done_lock(pending->mutex);
        pending->error = std::move(error);
        pending->done = true;
        pending->finished.store(true, std::memory_order_release);
        pending->changed.notify_all();
      });
    }
    queued_.notify_one();
    return std::make_shared<MpiWork>(std::move(pending), std::move(what), rank_, size_, timeout_, spin_,
                                     std::move(finish));
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) {
        return; // stop_, with nothing left to run
      }
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  TheProcessGroup the_one_; // first: claimed before anything calls MPI, released after all
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  bool one_node_ = false;
  std::unique_ptr<SharedMemoryCollectives> shm_; // where every rank is on this host
  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_; // last: started once the rest exists
};

} // namespace

bool mpi_available() {
  return true;
}

std::shared_ptr<GroupImpl> make_mpi_group(int rank, int size, std::chrono::milliseconds timeout) {
  const auto spin = wait_spin("LOCKSTEP_MPI_SPIN_US", "an MPI collective"); // fails before MPI starts
  // Before the group's collective setup, which a subgroup's ranks alone
  // would wait in until the deadline. (A size above MPI's is a launcher's
  // count that MPI did not start: the check after the setup says so.)
  const int world = init_mpi();
  TORCH_CHECK(size >= world, "lockstep: the mpi backend makes the group of all MPI's ", world, " ranks, not one of ",
              size, ": it has no subgroups. Make subgroups with the gloo backend (new_group(store, rank, ", size,
              ", \"gloo\")), or give every rank's size as MPI's.");
  auto group = std::make_shared<MpiGroup>(timeout, spin);
  TORCH_CHECK(group->rank() == rank && group->size() == size, "lockstep: the launcher says rank ", rank, " of ", size,
              " but MPI says rank ", group->rank(), " of ", group->size(),
              ". Start every rank with one mpirun (or srun) and do not mix it with torchrun's RANK/WORLD_SIZE.");
  return group;
}

} // namespace detail
} // namespace lockstep
