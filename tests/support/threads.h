#pragma once

// Ranks as threads of one process over an in-memory store, as Gloo's tests
// run them: fast, and a failure on any rank fails the test.

#include <lockstep/process_group.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace testing {

// A check of the shared checks (support/*_checks.h) as a gtest failure.
inline const std::function<void(bool ok, const std::string& what)> kCheck = [](bool ok, const std::string& what) {
  if (!ok) {
    ADD_FAILURE() << what;
  }
};

// Runs fn(group) on `size` threads, one per rank, over one HashStore; rethrows
// the first failure.
inline void spawn(
    int size,
    const std::function<void(ProcessGroup&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::string& backend = "gloo") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::exception_ptr error;
  std::mutex mutex;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto group = new_group(store, rank, size, backend, timeout);
        fn(group);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) {
          error = std::current_exception();
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

// Runs fn(group) on `size` ranks as spawn() does, and returns what each rank's
// fn returned (its error's text, say), by rank.
inline std::vector<std::string> strings_by_rank(int size, const std::function<std::string(ProcessGroup&)>& fn,
                                                std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  std::mutex mutex;
  std::vector<std::string> by_rank(size);
  spawn(
      size,
      [&](ProcessGroup& group) {
        const std::string text = fn(group);
        std::lock_guard<std::mutex> lock(mutex);
        by_rank[group.rank()] = text;
      },
      timeout);
  return by_rank;
}

} // namespace testing
} // namespace lockstep
