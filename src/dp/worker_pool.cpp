#include "dp/worker_pool.h"

#include <lockstep/timeline.h>

#include "dp/cpu_threads.h"
#include "util/autocast_state.h"
#include "util/caller_stream.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>

namespace lockstep {
namespace detail {

struct WorkerPool::Worker {
  std::thread thread;
  std::condition_variable cv;
  std::function<void()> task; // guarded by WorkerPool::mutex_
  bool stop = false;
};

WorkerPool::WorkerPool(const std::vector<int>& intra_op_threads, bool cache_cpu_memory)
    : cache_user_(cache_cpu_memory ? std::make_unique<CpuCacheUser>() : nullptr) {
  const int caller_threads = at::get_num_threads();
  workers_.reserve(intra_op_threads.size());
  for (int threads : intra_op_threads) {
    TORCH_INTERNAL_ASSERT(threads > 0);
    try {
      auto worker = std::make_unique<Worker>();
      Worker& w = *worker;
      w.thread = std::thread([this, &w, threads] { loop(w, threads); });
      workers_.push_back(std::move(worker)); // reserved: cannot throw
    } catch (const std::exception& e) { // std::system_error, or std::bad_alloc for the thread's state
      // The workers already started run on this object: end them before the
      // constructor throws, or their std::thread's destructor terminates.
      stop_and_join();
      at::set_num_threads(caller_threads); // as below
      TORCH_CHECK(false, "lockstep::DataParallel: the system refused thread ", workers_.size() + 1, " of the ",
                  intra_op_threads.size(), " that run the replicas, one per device (", e.what(), "). A limit on "
                  "threads or memory (ulimit -u, ulimit -v, a container's pids limit) is in the way: raise it, or "
                  "give DataParallel fewer devices.");
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return started_ == workers_.size(); });
  lock.unlock();
  // at::set_num_threads also stores a process-wide count that threads read
  // on their first parallel op; put back the caller's so that threads created
  // later (and the caller itself) keep using every core.
  at::set_num_threads(caller_threads);
}

WorkerPool::~WorkerPool() {
  stop_and_join();
}

void WorkerPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : workers_) {
      w->stop = true;
      w->cv.notify_one();
    }
  }
  for (auto& w : workers_) {
    w->thread.join();
  }
}

void WorkerPool::loop(Worker& worker, int threads) {
  // LibTorch initialises each thread's OpenMP count lazily, from the
  // process-wide count, on the thread's first parallel region; done later, that
  // would overwrite the count set below. So run the lazy init first, inside
  // libtorch: at::get_num_threads() does. Calling
  // at::internal::lazy_init_num_threads() here would not do: in 2.x it is
  // inline, and its once-per-thread flag is our copy, not libtorch's.
  at::get_num_threads();
  at::set_num_threads(threads);

  std::unique_lock<std::mutex> lock(mutex_);
  ++started_;
  done_cv_.notify_all();
  while (true) {
    worker.cv.wait(lock, [&] { return worker.stop || worker.task; });
    if (worker.stop) {
      return;
    }
    auto task = std::move(worker.task);
    worker.task = nullptr;
    lock.unlock();
    task(); // never throws: run() wraps it
    release_idle_openmp_team(); // before run() returns: Note [CPU replicas and threads]
    lock.lock();
    if (--pending_ == 0) {
      done_cv_.notify_all();
    }
  }
}

std::vector<std::exception_ptr> WorkerPool::run(
    const std::vector<size_t>& which,
    const std::function<void(size_t)>& fn) {
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  std::vector<std::exception_ptr> errors(which.size());
  std::unique_lock<std::mutex> lock(mutex_);
  pending_ = which.size();
  for (size_t slot = 0; slot < which.size(); ++slot) {
    const size_t index = which[slot];
    TORCH_INTERNAL_ASSERT(index < workers_.size());
    Worker& w = *workers_[index];
    TORCH_INTERNAL_ASSERT(!w.task);
    w.task = [&fn, &errors, slot, index] {
      try {
        fn(index);
      } catch (...) {
        errors[slot] = std::current_exception();
      }
    };
    w.cv.notify_one();
  }
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  return errors;
}

namespace {

[[noreturn]] void throw_replica_error(size_t replica, torch::Device device, const char* stage, std::exception_ptr error) {
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    message = e.msg();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  TORCH_CHECK(false, "lockstep::DataParallel: replica ", replica, " on ", device, " failed in ", stage, ": ", message);
}

} // namespace

void map_replicas(
    WorkerPool& pool,
    const std::vector<size_t>& which,
    const std::vector<torch::Device>& devices,
    const char* stage,
    const std::function<void(size_t)>& fn) {
  at::ThreadLocalState state;
  const auto autocast = AutocastState::current(); // Note [Mixed precision] in src/amp.cpp
  // Note [The caller's stream]: every replica's thread takes the caller's
  // current stream on every device of the step, not only its own: a copy
  // between devices (the input scattered from the first device, a gradient
  // brought back) runs on the current stream of its source device.
  std::vector<c10::Stream> streams;
  for (const auto& device : devices) {
    const auto stream = caller_stream(device);
    if (stream && std::none_of(streams.begin(), streams.end(),
                               [&](const c10::Stream& s) { return s.device() == device; })) {
      streams.push_back(*stream);
    }
  }
  if (std::any_of(which.begin(), which.end(), [&](size_t r) { return devices[r].is_cpu(); })) {
    release_idle_openmp_team(); // Note [CPU replicas and threads]
  }
  auto errors = pool.run(which, [&](size_t r) {
    at::ThreadLocalStateGuard tls(state);
    ReplicaAutocast replica_autocast(autocast);
    CpuCacheScope cache(devices[r].is_cpu()); // Note [CPU replicas' memory] in src/util/cpu_cache.cpp
    c10::OptionalDeviceGuard device_guard;
    if (!devices[r].is_cpu()) {
      device_guard.reset_device(devices[r]);
    }
    c10::MultiStreamGuard stream_guard(streams);
    timeline::Span span([&] { return "replica " + std::to_string(r) + " " + stage; }); // Note [Timeline]
    fn(r);
  });
  for (size_t i = 0; i < which.size(); ++i) {
    if (errors[i]) {
      throw_replica_error(which[i], devices[which[i]], stage, errors[i]);
    }
  }
}

} // namespace detail
} // namespace lockstep
