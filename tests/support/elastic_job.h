#pragma once

// Elastic jobs of several lockstep-run nodes on one machine, for the tests
// (test_elastic.cpp): a job's nodes meeting at one --rdzv-endpoint, and
// waits on what they do.

#include "launch.h"
#include "processes.h"

#include <tools/kv_store.h>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {
namespace testing {
namespace jobs {

// Short timings, so that a lost node is seen within a second.
inline const std::string kQuickRendezvous = "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=4,join_timeout=60";

// A job long enough to be interrupted: 8192 samples, 2 epochs, a checkpoint every 4 steps.
inline std::vector<std::string> long_trainer(const std::string& name) {
  return with_flag(trainer(name, temp(name + ".ckpt")), "--train-samples", "8192");
}

// Waits until something listens on HOST:PORT (a TCP connection succeeds).
inline bool wait_for_listener(const std::string& endpoint) {
  const int store_port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  for (int i = 0; i < 400; ++i) {
    try {
      tools::KvClient probe("127.0.0.1", store_port, std::chrono::milliseconds(500)); // connects, sends nothing
      return true;
    } catch (const tools::KvError&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return false;
}

struct ElasticJob {
  ElasticJob(std::string name, std::string nnodes) : name(std::move(name)), nnodes(std::move(nnodes)) {}
  std::string name;
  std::string nnodes;
  std::string endpoint = "127.0.0.1:" + port();
  std::string rdzv_conf = kQuickRendezvous;
  std::vector<std::string> extra; // more launcher flags
  std::vector<std::string> program; // the rank's command line; empty: lockstep-train
  std::vector<Process> nodes;

  // Starts one more node: a lockstep-run of one rank of `program`.
  Process& start_node(const std::vector<std::string>& env = {}) {
    std::vector<std::string> flags{"--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                                   "--rdzv-id", name, "--rdzv-conf", rdzv_conf};
    flags.insert(flags.end(), extra.begin(), extra.end());
    std::vector<std::string> all_env{kOneThread};
    all_env.insert(all_env.end(), env.begin(), env.end());
    nodes.push_back(testing::start(launcher(flags, program.empty() ? long_trainer(name) : program), all_env,
                                   temp(name + "_node" + std::to_string(nodes.size()) + ".log")));
    return nodes.back();
  }
  // Starts the first node and waits until it serves the store: the node the
  // tests kill must not be the store's.
  void start_host() {
    start_node();
    EXPECT_TRUE(wait_for_listener(endpoint)) << "the first node never served the store at " << endpoint;
  }
  std::string checkpoint() const {
    return temp(name + ".ckpt");
  }
};

// Waits until `path` exists: the job has trained some steps.
inline bool wait_for_file(const std::string& path, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// SIGKILL to a node's launcher alone: its ranks die with it (PR_SET_PDEATHSIG), as on a lost machine.
inline void kill_node(Process& p) {
  kill(p.pid, SIGKILL);
  waitpid(p.pid, nullptr, 0);
  p.pid = 0;
}

} // namespace jobs
} // namespace testing
} // namespace lockstep
