// lockstep-train --deterministic: the same final parameters at every world
// size that divides the micro-batches, under DDP, every --sharding and
// DataParallel, in fp32 and bf16, and after a resume at another world size
// (Note [The same bits at any world size]).

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

// 48-sample batches of 6 micro-batches: 1, 2 and 3 ranks share them.
std::vector<std::string> deterministic(const std::string& marker, const std::string& checkpoint = "") {
  auto args = with_flag(trainer(marker, checkpoint), "--batch-size", "48");
  args.insert(args.end(), {"--deterministic", "--micro-batch-size", "8"});
  return args;
}

Process ranks(int world, const std::vector<std::string>& args, const std::string& name,
              const std::vector<std::string>& env = {}) {
  return launch({"--nproc-per-node", std::to_string(world), "--master-port", port()}, args, name, env);
}

TEST(TrainerDeterministic, OneTwoAndThreeRanksEndWithTheSameParameters) {
  std::vector<std::string> hashes;
  for (int world : {1, 2, 3}) {
    const auto p = ranks(world, deterministic("det" + std::to_string(world)), "det" + std::to_string(world));
    ASSERT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find("deterministic: 6 micro-batches of 8 a batch"), std::string::npos) << p.output;
    hashes.push_back(final_hash(p.output));
    EXPECT_FALSE(hashes.back().empty()) << p.output;
  }
  EXPECT_EQ(hashes[0], hashes[1]);
  EXPECT_EQ(hashes[0], hashes[2]);
}

TEST(TrainerDeterministic, Bf16OnOneAndTwoRanksEndsWithTheSameParameters) {
  auto bf16 = [](const std::string& marker) {
    auto args = deterministic(marker);
    args.insert(args.end(), {"--precision", "bf16"});
    return args;
  };
  const auto one = ranks(1, bf16("det_bf16_1"), "det_bf16_1");
  const auto two = ranks(2, bf16("det_bf16_2"), "det_bf16_2");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_EQ(final_hash(one.output), final_hash(two.output)) << one.output << two.output;
  EXPECT_NE(final_hash(one.output), final_hash(ranks(1, deterministic("det_fp32"), "det_fp32").output));
}

std::vector<std::string> sharded(const std::string& marker, const std::string& sharding,
                                 const std::string& checkpoint = "") {
  auto args = deterministic(marker, checkpoint);
  args.insert(args.end(), {"--sharding", sharding});
  return args;
}

// Note [Sharded exact sums]: every --sharding at 1, 2 and 3 ranks, and
// DataParallel on two replicas, end with DDP's parameters, and a sharded run
// in bf16 with DDP's in bf16.
TEST(TrainerDeterministic, EveryShardingAndDataParallelEndWithDdpsParameters) {
  const auto ddp = ranks(2, deterministic("det_ddp"), "det_ddp");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const std::vector<std::pair<std::string, int>> runs = {{"full", 3}, {"grad-op", 2}, {"none", 1}};
  for (const auto& [sharding, world] : runs) {
    const std::string name = "det_" + sharding + std::to_string(world);
    const auto p = ranks(world, sharded(name, sharding), name);
    ASSERT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find("(--sharding " + sharding + ") over " + std::to_string(world) + " ranks ("),
              std::string::npos) << p.output;
    EXPECT_NE(p.output.find("deterministic: 6 micro-batches of 8 a batch"), std::string::npos) << p.output;
    EXPECT_EQ(final_hash(p.output), final_hash(ddp.output)) << p.output;
  }
  auto replicas = deterministic("det_dp");
  replicas.insert(replicas.end(), {"--replicas", "2"});
  const auto dp = testing::run(replicas, {}, temp("det_dp.log"), kDeadline);
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  EXPECT_NE(dp.output.find("DataParallel on [cpu,cpu], deterministic: 6 micro-batches"), std::string::npos) << dp.output;
  EXPECT_EQ(final_hash(dp.output), final_hash(ddp.output)) << dp.output;
  auto bf16 = [](std::vector<std::string> args) {
    args.insert(args.end(), {"--precision", "bf16"});
    return args;
  };
  const auto ddp_bf16 = ranks(1, bf16(deterministic("det_ddp_bf16")), "det_ddp_bf16");
  const auto full_bf16 = ranks(2, bf16(sharded("det_full_bf16", "full")), "det_full_bf16");
  ASSERT_EQ(full_bf16.exit_code, 0) << full_bf16.output;
  EXPECT_EQ(final_hash(full_bf16.output), final_hash(ddp_bf16.output)) << full_bf16.output << ddp_bf16.output;
}

// Two ranks stop at step 10 (the checkpoint is step 8's); three go on from
// there, and end where two ranks that never stopped end.
TEST(TrainerDeterministic, AResumeAtAnotherWorldSizeEndsWithTheUninterruptedParameters) {
  const std::string checkpoint = temp("det_resume.ckpt");
  const auto whole = ranks(2, deterministic("det_whole"), "det_whole");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto stopped = ranks(2, deterministic("det_resume", checkpoint), "det_stopped", {"LOCKSTEP_FAULT=0:10"});
  ASSERT_NE(stopped.exit_code, 0) << stopped.output;
  const auto resumed = ranks(3, deterministic("det_resume", checkpoint), "det_resumed");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("at step 8"), std::string::npos) << resumed.output;
  EXPECT_EQ(final_hash(resumed.output), final_hash(whole.output)) << resumed.output;
  // Sharded: two ranks' sharded checkpoint resumed by three (the optimizer's
  // state resharded), and still DDP's parameters.
  const std::string shards = temp("det_resume_sharded.ckpt");
  const auto stopped_sharded = ranks(2, sharded("det_resume_sharded", "full", shards), "det_stopped_sharded",
                                     {"LOCKSTEP_FAULT=0:10"});
  ASSERT_NE(stopped_sharded.exit_code, 0) << stopped_sharded.output;
  const auto resumed_sharded = ranks(3, sharded("det_resume_sharded", "full", shards), "det_resumed_sharded");
  ASSERT_EQ(resumed_sharded.exit_code, 0) << resumed_sharded.output;
  EXPECT_NE(resumed_sharded.output.find("at step 8"), std::string::npos) << resumed_sharded.output;
  EXPECT_EQ(final_hash(resumed_sharded.output), final_hash(whole.output)) << resumed_sharded.output;
}

// A command line is refused before anything starts (exit 2); a world size
// that cannot share the micro-batches, by every rank.
TEST(TrainerDeterministic, WhatCannotBeKeptExactIsRefused) {
  auto alone = [](const std::vector<std::string>& args, const std::string& name) {
    return testing::run(args, {}, temp(name + ".log"), kDeadline);
  };
  auto refused = [](const Process& p, int exit_code, const std::string& says) {
    EXPECT_EQ(p.exit_code, exit_code) << p.output;
    EXPECT_NE(p.output.find(says), std::string::npos) << p.output;
  };
  auto without_size = trainer("det_refused");
  without_size.push_back("--deterministic");
  refused(alone(without_size, "det_no_size"), 2, "--deterministic needs --micro-batch-size N");
  refused(alone(with_flag(deterministic("det_refused"), "--micro-batch-size", "7"), "det_size7"), 2,
          "--batch-size 48 is not a multiple of --micro-batch-size 7");
  auto hooked = deterministic("det_refused");
  hooked.insert(hooked.end(), {"--comm-hook", "fp16"});
  refused(ranks(1, hooked, "det_hooked"), 1, "it takes no --comm-hook");
  refused(ranks(4, deterministic("det_refused"), "det_four"), 1, "6 micro-batches of --micro-batch-size 8, which 4 ranks");
}

} // namespace
} // namespace lockstep
