#pragma once

// Internal: Lockstep's rings over c10d's Gloo send and recv, the group's
// all-gathers and reduce-scatters of CPU tensors (Note [Gloo's
// reduce-scatter] in src/comm/backends/gloo_rings.cpp), and the thread and
// Work they run on.

#include <lockstep/backend.h>
#include <lockstep/detail/c10d_group.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

/// How many tags a ring takes from `first_tag` on, in a group of `size`:
/// size-1 for its steps' data and as many for their words.
inline int tags_per_ring(int size) {
  return 2 * size;
}

/// Rank r's `output` (n elements) receives every rank's input[r*n, (r+1)*n)
/// reduced by `op`, as a ring. `words`, where defined, is a planned
/// collective's room (Note [Planned rings] in src/comm/planned_collective.cpp),
/// whose every slot holds its rank's words once the ring returns.
void ring_reduce_scatter(c10d::ProcessGroupGloo& group, torch::Tensor output, const torch::Tensor& input, ReduceOp op,
                         int first_tag, const torch::Tensor& words);

/// outputs[r] receives rank r's `input`, as a ring; `words` as above.
void ring_all_gather(c10d::ProcessGroupGloo& group, std::vector<torch::Tensor> outputs, const torch::Tensor& input,
                     int first_tag, const torch::Tensor& words);

// Runs the rings one after another on a thread of the group's own.
class RingThread {
 public:
  ~RingThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    queued_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }
  std::shared_future<void> run(std::function<void()> ring) {
    // The ring, and the tensors it holds, are released before its future is
    // ready: a caller that counts who holds a tensor (Note [Gradients that
    // are bucket slots]) must not find the finished ring among them.
    std::packaged_task<void()> task([ring = std::move(ring)]() mutable { std::exchange(ring, nullptr)(); });
    auto done = task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable()) {
        thread_ = std::thread([this] { loop(); });
      }
      queue_.push_back(std::move(task));
    }
    queued_.notify_one();
    return done;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) {
          return;
        }
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class RingWork : public Work {
 public:
  RingWork(std::shared_future<void> done, std::string what, int rank, int size, std::chrono::milliseconds timeout,
           Diagnose diagnose, std::chrono::microseconds spin)
      : done_(std::move(done)), what_(std::move(what)), rank_(rank), size_(size), timeout_(timeout),
        diagnose_(std::move(diagnose)), spin_(spin) {}
  void wait() override {
    poll_for(spin_, [&] { return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    // Gloo bounds each send and recv by the same timeout; this bounds a ring
    // stuck behind another.
    if (done_.wait_for(timeout_ * size_) == std::future_status::timeout) {
      throw_collective_error(what_, rank_, size_, timeout_, "the ring's steps did not complete", diagnose_);
    }
    try {
      done_.get();
    } catch (const c10::Error& e) {
      throw_collective_error(what_, rank_, size_, timeout_, e.msg(), diagnose_); // without its C++ backtrace
    } catch (const std::exception& e) {
      throw_collective_error(what_, rank_, size_, timeout_, e.what(), diagnose_);
    }
  }

 private:
  std::shared_future<void> done_;
  std::string what_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  Diagnose diagnose_;
  std::chrono::microseconds spin_;
};

} // namespace detail
} // namespace lockstep
