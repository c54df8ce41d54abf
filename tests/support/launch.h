#pragma once

// Running lockstep-run and lockstep-train from tests: their command lines, a
// temporary folder per test process, and what their output says.

#include "processes.h"
#include "scratch.h"

#include <gtest/gtest.h>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {
namespace jobs {

constexpr auto kDeadline = std::chrono::seconds(180);
// Bitwise comparisons need the same intra-op thread count per rank in every
// run: lockstep-run's default (cores / ranks per node) differs between one
// node of 2 ranks and two nodes of 1.
inline const std::string kOneThread = "OMP_NUM_THREADS=1";

inline std::string temp(const std::string& name) {
  return scratch(name);
}

// A small job: 1024 samples, batch 64, 2 epochs (32 steps at world size 2).
inline std::vector<std::string> trainer(const std::string& marker, const std::string& checkpoint = "") {
  std::vector<std::string> args{LOCKSTEP_TRAIN, "--train-samples", "1024", "--test-samples", "256", "--batch-size", "64",
                                "--epochs", "2", "--save", temp(marker + ".pt"), "--synthetic", "--out", temp(marker + "_out")};
  if (!checkpoint.empty()) {
    args.insert(args.end(), {"--checkpoint", checkpoint, "--checkpoint-every", "4"});
  }
  return args;
}

/// `args` with the value after `flag` replaced, so that a test changes one
/// flag of trainer()'s command line by name.
inline std::vector<std::string> with_flag(std::vector<std::string> args, const std::string& flag, const std::string& value) {
  auto it = std::find(args.begin(), args.end(), flag);
  EXPECT_TRUE(it != args.end() && it + 1 != args.end()) << flag << " is not in the command line";
  if (it != args.end() && it + 1 != args.end()) {
    *(it + 1) = value;
  }
  return args;
}

/// `args` with --sharding `strategy`: FullyShardedDataParallel.
inline std::vector<std::string> sharded(std::vector<std::string> args, const std::string& strategy) {
  args.insert(args.end(), {"--sharding", strategy});
  return args;
}

inline std::vector<std::string> launcher(std::vector<std::string> flags, const std::vector<std::string>& program) {
  flags.insert(flags.begin(), LOCKSTEP_RUN);
  flags.insert(flags.end(), program.begin(), program.end());
  return flags;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline std::string final_hash(const std::string& output) {
  std::smatch m;
  return std::regex_search(output, m, std::regex("fnv1a64=([0-9a-f]{16})")) ? m[1].str() : "";
}

inline Process launch(const std::vector<std::string>& flags, const std::vector<std::string>& program, const std::string& name,
               const std::vector<std::string>& env = {}) {
  return testing::run(launcher(flags, program), env, temp(name + ".log"), kDeadline);
}

inline std::string port() {
  return std::to_string(testing::free_port());
}

// Runs `make(name)`, a trainer's command line writing under `name`, over 2
// ranks without and with --activation-checkpointing, under DDP and under
// --sharding full: each pair must end with the same parameters, to the bit.
inline void expect_checkpointing_keeps_the_bits(const std::string& marker,
                                                const std::function<std::vector<std::string>(const std::string&)>& make) {
  for (const std::string sharding : {"", "full"}) {
    std::string hashes[2];
    for (bool checkpointed : {false, true}) {
      const std::string name = marker + sharding + (checkpointed ? "_checkpointed" : "");
      auto args = make(name);
      args.insert(args.end(), {"--dropout", "0.1"}); // checkpointing draws dropout's numbers again
      if (!sharding.empty()) {
        args.insert(args.end(), {"--sharding", sharding});
      }
      if (checkpointed) {
        args.push_back("--activation-checkpointing");
      }
      const auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, args, name);
      ASSERT_EQ(p.exit_code, 0) << p.output;
      hashes[checkpointed] = final_hash(p.output);
      EXPECT_FALSE(hashes[checkpointed].empty()) << p.output;
    }
    EXPECT_EQ(hashes[0], hashes[1]) << marker << ", --sharding '" << sharding << "'";
  }
}

// The last epoch's line: train loss and accuracy, test loss and accuracy.
inline std::string epoch_figures(const std::string& output) {
  std::smatch m;
  return std::regex_search(output, m, std::regex("epoch 2/2: train loss [0-9.]+, train accuracy [0-9.]+%, test loss "
                                                 "[0-9.]+, test accuracy [0-9.]+%")) ? m[0].str() : "";
}

// The uninterrupted reference: 2 ranks on one node.
inline const Process& reference_run() {
  static const Process p = [] {
    auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("reference"), "reference", {kOneThread});
    EXPECT_EQ(p.exit_code, 0) << p.output;
    return p;
  }();
  return p;
}

inline const std::string& reference_hash() {
  static const std::string hash = final_hash(reference_run().output);
  return hash;
}

// Two nodes of one rank each on this machine (a lockstep-run each), node N
// running program(N); waits for both.
inline std::vector<Process> run_two_nodes(const std::string& name, const std::function<std::vector<std::string>(int)>& program) {
  const std::string master_port = port();
  std::vector<Process> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(testing::start(
        launcher({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1", "--master-addr",
                  "127.0.0.1", "--master-port", master_port},
                 program(node)),
        {kOneThread}, temp(name + std::to_string(node) + ".log")));
  }
  testing::wait_all(nodes, kDeadline);
  return nodes;
}

// A pid that no process has now: a child that has exited and been reaped.
inline pid_t dead_pid() {
  const pid_t pid = fork();
  if (pid == 0) {
    _exit(0);
  }
  waitpid(pid, nullptr, 0);
  return pid;
}

// The trainer's summary test accuracy, in percent; -1 without one.
inline double test_accuracy(const std::string& output) {
  std::smatch m;
  return std::regex_search(output, m, std::regex("last epoch: .*test accuracy ([0-9.]+)%")) ? std::stod(m[1].str()) : -1;
}

} // namespace jobs
} // namespace testing
} // namespace lockstep
