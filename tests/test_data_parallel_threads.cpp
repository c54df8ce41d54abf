// DataParallel's CPU replicas and the threads around them (Note [CPU replicas
// and threads] in src/dp/data_parallel.cpp): each replica's share of the cores,
// the caller's count afterwards, and no idle OpenMP team left spinning on a
// core that another thread needs.

#include "../src/util/cpu_cache.h"
#include "support/dp_models.h"

#include <lockstep/lockstep.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

using testing::dp_models::cpus;

// The kernel thread ids of the calling thread's OpenMP team, less the thread
// itself: one parallel region with a chunk per intra-op thread.
std::vector<pid_t> openmp_team_helpers() {
  const auto self = static_cast<pid_t>(syscall(SYS_gettid));
  std::mutex mutex;
  std::vector<pid_t> helpers;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const auto tid = static_cast<pid_t>(syscall(SYS_gettid));
    std::lock_guard<std::mutex> lock(mutex);
    if (tid != self) {
      helpers.push_back(tid);
    }
  });
  // Read under the mutex too: the region's end orders the writes, but inside
  // libgomp, where ThreadSanitizer does not see it.
  std::lock_guard<std::mutex> lock(mutex);
  return helpers;
}

// How many of `tids` are still threads of this process.
int alive(const std::vector<pid_t>& tids) {
  int count = 0;
  for (pid_t tid : tids) {
    count += access(("/proc/self/task/" + std::to_string(tid)).c_str(), F_OK) == 0;
  }
  return count;
}

TEST(DataParallelThreads, CpuReplicasOwnPersistentThreadsAndShareTheCores) {
  at::set_num_threads(4); // the caller's count is what the replicas split
  torch::nn::Linear net(16, 4);
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(3)));
  auto threads = dp->map_replicas([](torch::nn::LinearImpl&) { return at::get_num_threads(); });
  EXPECT_EQ(threads, (std::vector<int>{2, 1, 1})); // 4 cores over 3 replicas
  auto ids = dp->map_replicas([](torch::nn::LinearImpl&) { return std::this_thread::get_id(); });
  dp(torch::randn({6, 16}));
  EXPECT_EQ(dp->map_replicas([](torch::nn::LinearImpl&) { return std::this_thread::get_id(); }), ids); // the same threads again
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], std::this_thread::get_id());

  DataParallel<torch::nn::Linear> fixed(torch::nn::Linear(16, 4), DataParallelOptions().devices(cpus(2)).intra_op_threads(3));
  EXPECT_EQ(fixed->map_replicas([](torch::nn::LinearImpl&) { return at::get_num_threads(); }), (std::vector<int>{3, 3}));
}

// A bare module stepped on the caller's thread after DataParallel must find
// the caller's own count.
TEST(DataParallelThreads, CallersThreadCountComesBackAfterForwardAndBackward) {
  at::set_num_threads(2);
  torch::nn::Linear net(16, 4);
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(2)));
  auto out = dp(torch::randn({6, 16}));
  EXPECT_EQ(at::get_num_threads(), 2) << "after forward";
  out.sum().backward();
  EXPECT_EQ(at::get_num_threads(), 2) << "after backward";
  dp->map_replicas([](torch::nn::LinearImpl&) {});
  EXPECT_EQ(at::get_num_threads(), 2) << "after map_replicas";
}

// The caller's last parallel region (an optimizer step, say) leaves its team
// idle, and libgomp keeps it spinning for milliseconds. Those threads must be
// gone while the replicas run, and a new team must serve the caller after.
TEST(DataParallelThreads, CallersIdleOpenMpTeamEndsBeforeReplicasRun) {
  at::set_num_threads(2);
  torch::nn::Linear net(16, 4);
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(2)));
  const auto helpers = openmp_team_helpers();
  ASSERT_EQ(helpers.size(), 1u) << "the caller's parallel region ran on one thread";
  ASSERT_EQ(alive(helpers), 1) << "the idle team is there before DataParallel runs";

  EXPECT_EQ(dp->map_replicas([&](torch::nn::LinearImpl&) { return alive(helpers); }), (std::vector<int>{0, 0}));
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(openmp_team_helpers().size(), 1u) << "the caller's next region has its two threads again";
  dp(torch::randn({6, 16})).sum().backward();
  EXPECT_EQ(openmp_team_helpers().size(), 1u) << "after forward and backward";
}

// With more cores than replicas, each replica has a team of its own; once its
// work is done, that team must not spin on the cores the caller's next step
// (its optimizer, its loss) needs.
TEST(DataParallelThreads, ReplicasIdleOpenMpTeamsEndWithTheirWork) {
  torch::nn::Linear net(16, 4);
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(2)).intra_op_threads(2));
  const auto teams = dp->map_replicas([](torch::nn::LinearImpl&) { return openmp_team_helpers(); });
  for (size_t r = 0; r < teams.size(); ++r) {
    ASSERT_EQ(teams[r].size(), 1u) << "replica " << r << "'s region ran on one thread";
    EXPECT_EQ(alive(teams[r]), 0) << "replica " << r << "'s idle team outlived its work";
  }
  // ... and they start again for the next call, with the replica's count.
  EXPECT_EQ(dp->map_replicas([](torch::nn::LinearImpl&) { return openmp_team_helpers().size(); }),
            (std::vector<size_t>{1, 1}));
}

// With one core each, a replica runs every op on its own thread: no OpenMP
// team of its own, so no helper to spin or compete for a core; and a
// training step leaves the process with as many threads as the one before.
TEST(DataParallelThreads, ReplicasWithOneThreadEachStartNoOpenMpTeam) {
  at::set_num_threads(2);
  torch::nn::Sequential net(torch::nn::Linear(256, 512), torch::nn::ReLU(), torch::nn::Linear(512, 10));
  DataParallel<torch::nn::Sequential> dp(net, DataParallelOptions().devices(cpus(2)));
  EXPECT_EQ(dp->map_replicas([](torch::nn::SequentialImpl&) { return openmp_team_helpers().size(); }),
            (std::vector<size_t>{0, 0}));
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  const auto x = torch::randn({64, 256});
  auto step = [&] {
    optimizer.zero_grad();
    dp(x).sum().backward();
    optimizer.step();
  };
  auto threads = [] {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("Threads:", 0) == 0) {
        return std::stoi(line.substr(8));
      }
    }
    return -1;
  };
  step();
  const int after_one = threads();
  for (int i = 0; i < 3; ++i) {
    step();
  }
  EXPECT_EQ(threads(), after_one);
}

// Note [CPU replicas' memory]: once the first steps have run, the replicas'
// large allocations come from the cache, not from the system; the caller's
// own allocations do not; and the cache gives its memory back when the last
// DataParallel with CPU replicas ends.
TEST(DataParallelThreads, CpuReplicasReuseTheirMemoryFromStepToStep) {
  torch::nn::Sequential net(torch::nn::Linear(256, 512), torch::nn::ReLU(), torch::nn::Linear(512, 10));
  const auto x = torch::randn({64, 256});
  {
    DataParallel<torch::nn::Sequential> dp(net, DataParallelOptions().devices(cpus(2)));
    torch::optim::SGD optimizer(net->parameters(), 0.1);
    auto step = [&] {
      optimizer.zero_grad();
      dp(x).sum().backward();
      optimizer.step();
    };
    for (int i = 0; i < 3; ++i) {
      step();
    }
    const auto warm = detail::cpu_cache_stats();
    constexpr int kSteps = 10;
    for (int i = 0; i < kSteps; ++i) {
      step();
    }
    const auto steady = detail::cpu_cache_stats();
    // The two replicas' timing decides how many blocks of a class are live
    // at once, so a later step may still reach a new most and take a block
    // fresh; but nearly every large allocation must be served by the cache.
    const auto reused = steady.reused - warm.reused, fresh = steady.fresh - warm.fresh;
    EXPECT_GE(reused, 4 * kSteps) << "each step reuses its weight gradients and activations";
    EXPECT_GE(reused, 9 * fresh) << "steady steps took " << fresh << " blocks fresh from the system";
    EXPECT_GT(steady.idle_bytes, 0u);

    auto on_caller = torch::ones({1 << 20});
    const auto after_caller = detail::cpu_cache_stats();
    EXPECT_EQ(after_caller.fresh, steady.fresh) << "the caller's allocation went through the cache";
    EXPECT_EQ(after_caller.reused, steady.reused) << "the caller's allocation went through the cache";
    EXPECT_EQ(on_caller.sum().item<float>(), float(1 << 20));
  }
  EXPECT_EQ(detail::cpu_cache_stats().idle_bytes, 0u) << "the cache kept its memory after the last DataParallel ended";
}

} // namespace
} // namespace lockstep
