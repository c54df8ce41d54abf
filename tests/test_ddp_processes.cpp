// DistributedDataParallel with real processes: two ranks of
// lockstep_ddp_worker on localhost over a TCPStore, started the way
// torchrun starts them (environment variables).

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

// A port nobody listens on right now (the kernel picks it).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

struct RankResult {
  int exit_code = -1; // -1: killed at the deadline
  double seconds = 0;
  std::string output;
};

// Starts `world` ranks of the worker on `scenario` and waits for them, at
// most `deadline`; ranks still running then are killed and reported as -1.
std::vector<RankResult> run_ranks(const std::string& scenario, int world, std::chrono::seconds deadline) {
  const int port = free_port();
  std::vector<pid_t> pids(world);
  std::vector<std::string> logs(world);
  const auto start = Clock::now();
  for (int r = 0; r < world; ++r) {
    logs[r] = ::testing::TempDir() + "lockstep_ddp_" + scenario + "_" + std::to_string(r) + ".log";
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      env_strings.emplace_back(*e);
    }
    for (const std::string& kv : {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                                  "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                  std::string("MASTER_ADDR=127.0.0.1"), "MASTER_PORT=" + std::to_string(port),
                                  std::string("OMP_NUM_THREADS=1")}) {
      env_strings.push_back(kv);
    }
    std::vector<char*> env;
    for (auto& s : env_strings) {
      env.push_back(s.data());
    }
    env.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::string program = LOCKSTEP_DDP_WORKER;
    char* argv[] = {program.data(), const_cast<char*>(scenario.c_str()), nullptr};
    const int rc = posix_spawn(&pids[r], program.c_str(), &actions, nullptr, argv, env.data());
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0) << "could not start " << program;
  }
  std::vector<RankResult> results(world);
  int running = world;
  while (running > 0 && Clock::now() - start < deadline) {
    for (int r = 0; r < world; ++r) {
      if (pids[r] <= 0) {
        continue;
      }
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        results[r].seconds = std::chrono::duration<double>(Clock::now() - start).count();
        pids[r] = 0;
        --running;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    if (pids[r] > 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], nullptr, 0);
    }
    std::ifstream in(logs[r]);
    std::stringstream text;
    text << in.rdbuf();
    results[r].output = text.str();
  }
  return results;
}

std::string describe(const std::vector<RankResult>& results) {
  std::string text;
  for (size_t r = 0; r < results.size(); ++r) {
    text += "--- rank " + std::to_string(r) + " exit " + std::to_string(results[r].exit_code) + " after " +
        std::to_string(results[r].seconds) + " s\n" + results[r].output;
  }
  return text;
}

void expect_all_ok(const std::string& scenario) {
  auto results = run_ranks(scenario, 2, std::chrono::seconds(120));
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << describe(results);
    EXPECT_NE(results[r].output.find("rank " + std::to_string(r) + ": OK"), std::string::npos) << describe(results);
  }
}

TEST(DdpProcesses, TwoRanksMatchOneProcessOnTheWholeBatch) {
  expect_all_ok("equivalence");
}

TEST(DdpProcesses, GradientAsBucketViewWithManyBuckets) {
  expect_all_ok("views");
}

TEST(DdpProcesses, NoSyncAccumulatesWithoutCommunicating) {
  expect_all_ok("no_sync");
}

TEST(DdpProcesses, Fp16CompressionWithinTolerance) {
  expect_all_ok("fp16");
}

TEST(DdpProcesses, Bf16CompressionWithinTolerance) {
  expect_all_ok("bf16");
}

TEST(DdpProcesses, UnusedParametersAllowedWithTheOption) {
  expect_all_ok("unused_allowed");
}

TEST(DdpProcesses, UnusedParametersWithoutTheOptionFailOnEveryRank) {
  auto results = run_ranks("unused", 2, std::chrono::seconds(120));
  const auto all = describe(results);
  ASSERT_EQ(results[0].exit_code, 3) << all;
  ASSERT_EQ(results[1].exit_code, 3) << all;
  EXPECT_NE(results[1].output.find("rank 1: 2 parameter(s) received no gradient in this backward: 'branch.weight', 'branch.bias'"),
            std::string::npos) << all;
  EXPECT_NE(results[1].output.find("find_unused_parameters(true)"), std::string::npos) << all;
  EXPECT_NE(results[0].output.find("rank 0: 1 other rank(s) had parameters that received no gradient"), std::string::npos) << all;
}

TEST(DdpProcesses, ShapeMismatchFailsOnEveryRankNamingTheParameter) {
  auto results = run_ranks("mismatch", 2, std::chrono::seconds(120));
  const auto all = describe(results);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 3) << all;
    EXPECT_NE(results[r].output.find("rank 1's parameters differ from rank 0's at parameter 2: rank 0 has 'fc1.weight' [13, 7] Float"),
              std::string::npos) << all;
  }
  EXPECT_NE(results[1].output.find("rank 1 has 'fc1.weight' [12, 7] Float"), std::string::npos) << all;
}

TEST(DdpProcesses, StalledRankGivesATimeoutErrorNotAHang) {
  // Rank 1 stops participating for 8 s; the group's timeout is 3 s.
  auto results = run_ranks("stall", 2, std::chrono::seconds(60));
  const auto all = describe(results);
  ASSERT_EQ(results[0].exit_code, 3) << all;
  EXPECT_LT(results[0].seconds, 15.0) << all;
  EXPECT_NE(results[0].output.find("rank 0 of 2: allreduce of bucket 0"), std::string::npos) << all;
  EXPECT_NE(results[0].output.find("timeout of 3000 ms"), std::string::npos) << all;
}

} // namespace
