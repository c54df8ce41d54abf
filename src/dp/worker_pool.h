#pragma once

// Internal: the threads that run DataParallel's replicas.

#include "util/cpu_cache.h"

#include <torch/types.h>

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace lockstep {
namespace detail {

/// Persistent threads, one per replica. Each keeps its own intra-op thread
/// count for its whole life, so replicas on the CPU split the cores instead of
/// fighting over them, and ends its idle OpenMP team after each task. See
/// Note [CPU replicas and threads] in src/dp/data_parallel.cpp.
class WorkerPool {
 public:
  /// Starts one worker per entry; entry i is worker i's intra-op thread count.
  /// Returns once every worker has set its count, and restores the caller's
  /// count for threads created later. With `cache_cpu_memory`, the CPU memory
  /// cache stays open while the pool lives (Note [CPU replicas' memory] in
  /// src/util/cpu_cache.cpp).
  explicit WorkerPool(const std::vector<int>& intra_op_threads, bool cache_cpu_memory = false);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  size_t size() const {
    return workers_.size();
  }

  /// Runs `fn(i)` on worker i for each i in `which` and waits for all of them,
  /// also when some throw. Returns one exception slot per entry of `which`.
  /// Calls are serialised: one batch of work at a time.
  std::vector<std::exception_ptr> run(const std::vector<size_t>& which, const std::function<void(size_t)>& fn);

 private:
  struct Worker;
  void loop(Worker& worker, int threads);
  void stop_and_join();

  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  size_t pending_ = 0;
  size_t started_ = 0;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unique_ptr<CpuCacheUser> cache_user_;
};

/// Runs fn(r) for each replica r in `which` on its worker, with the caller's
/// thread-local state (grad mode, inference mode, autocast, profiler), device,
/// and current stream on that device; CPU replicas allocate from the CPU
/// memory cache. Before CPU replicas run, the caller's idle OpenMP team ends
/// (release_idle_openmp_team). Throws a c10::Error naming the first replica
/// that threw, its device and `stage`.
void map_replicas(
    WorkerPool& pool,
    const std::vector<size_t>& which,
    const std::vector<torch::Device>& devices,
    const char* stage,
    const std::function<void(size_t)>& fn);

} // namespace detail
} // namespace lockstep
