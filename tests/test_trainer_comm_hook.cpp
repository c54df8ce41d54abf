// lockstep-train --comm-hook: each hook trains under DDP and says so, and
// PowerSGD's state (each rank's error feedback, warm start, the iteration)
// resumes from the checkpoint with the rest of the run.

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;

std::vector<std::string> with_hook(std::vector<std::string> args, const std::string& hook) {
  args.insert(args.end(), {"--comm-hook", hook, "--powersgd-rank", "2", "--powersgd-start", "5"});
  return args;
}

TEST(TrainerCommHook, EachHookTrainsAndTheRunSaysWhich) {
  const double plain = test_accuracy(reference_run().output);
  ASSERT_GT(plain, 50) << reference_run().output;
  for (const auto& [hook, said] : {std::make_pair("fp16", "fp16-compressed gradients"),
                                   std::make_pair("bf16", "bf16-compressed gradients"),
                                   std::make_pair("powersgd", "PowerSGD (rank 2, from step 5)")}) {
    SCOPED_TRACE(std::string("--comm-hook ") + hook);
    const std::string name = std::string("hook_") + hook;
    auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, with_hook(trainer(name), hook), name, {kOneThread});
    ASSERT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find(said), std::string::npos) << p.output;
    EXPECT_NEAR(test_accuracy(p.output), plain, 5.0) << p.output;
  }
}

// A rank fails after the checkpoint at step 20, 15 steps into compression;
// the restart takes each rank's PowerSGD state back and ends bitwise where
// the uninterrupted run does. Without the state (error feedback lost, Q's
// drawn anew) it would not.
TEST(TrainerCommHook, PowerSGDResumesExactlyFromTheCheckpoint) {
  auto whole = launch({"--nproc-per-node", "2", "--master-port", port()}, with_hook(trainer("powersgd_whole"), "powersgd"),
                      "powersgd_whole", {kOneThread});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string checkpoint = temp("powersgd.ckpt");
  auto resumed = launch({"--nproc-per-node", "2", "--master-port", port(), "--max-restarts", "1"},
                        with_hook(trainer("powersgd_resumed", checkpoint), "powersgd"), "powersgd_resumed",
                        {"LOCKSTEP_FAULT=1:22", kOneThread});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + checkpoint + " at step 20"), std::string::npos) << resumed.output;
  EXPECT_EQ(final_hash(resumed.output), final_hash(whole.output)) << resumed.output;
}

// A resume with another --powersgd-rank trains on: the resume line names
// both settings, and PowerSGD draws its Q's anew at the new rank
// (Note [PowerSGD state of another rank]). The summary gives the
// compression rate, or says that no gradient was compressed.
TEST(TrainerCommHook, AResumeWithAnotherPowerSGDRankGoesOnAndTheSummaryGivesTheRate) {
  const std::string checkpoint = temp("powersgd_rank.ckpt");
  auto first = launch({"--nproc-per-node", "2", "--master-port", port()},
                      with_hook(trainer("powersgd_rank", checkpoint), "powersgd"), "powersgd_rank", {kOneThread});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_TRUE(std::regex_search(first.output, std::regex("PowerSGD compression rate [0-9.]+ \\(gradient elements over "
                                                         "elements sent"))) << first.output;
  auto args = with_flag(with_flag(with_hook(trainer("powersgd_rank2", checkpoint), "powersgd"), "--powersgd-rank", "1"),
                        "--epochs", "3");
  auto resumed = launch({"--nproc-per-node", "2", "--master-port", port()}, args, "powersgd_rank2", {kOneThread});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("; written with --powersgd-rank 2, and this run goes on with --powersgd-rank 1\n"),
            std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("16 steps (48 in all)"), std::string::npos) << resumed.output;
  // A later --powersgd-start: this run compresses nothing, and says so (it
  // gave the checkpoint's rate, in the summary and every metrics record).
  auto later = launch({"--nproc-per-node", "2", "--master-port", port()},
                      with_flag(with_flag(with_flag(args, "--powersgd-start", "1000"), "--epochs", "4"), "--out",
                                temp("powersgd_rank3_out")),
                      "powersgd_rank3", {kOneThread});
  ASSERT_EQ(later.exit_code, 0) << later.output;
  EXPECT_NE(later.output.find("; written with --powersgd-start 5, and this run goes on with --powersgd-start 1000\n"),
            std::string::npos) << later.output;
  EXPECT_NE(later.output.find("PowerSGD compressed nothing: it starts after --powersgd-start 1000"), std::string::npos)
      << later.output;
  const std::string later_metrics = read_text(temp("powersgd_rank3_out") + "/metrics.jsonl");
  const auto count = [&later_metrics](const std::string& text) {
    const std::regex pattern(text);
    return std::distance(std::sregex_iterator(later_metrics.begin(), later_metrics.end(), pattern), {});
  };
  EXPECT_GT(count("\"compression_rate\":"), 0) << later_metrics;
  EXPECT_EQ(count("\"compression_rate\":0.0[,}]"), count("\"compression_rate\":")) << later_metrics;
  auto huge = launch({"--nproc-per-node", "2", "--master-port", port()},
                     with_flag(with_hook(trainer("powersgd_huge"), "powersgd"), "--powersgd-rank", "1024"),
                     "powersgd_huge", {kOneThread});
  ASSERT_EQ(huge.exit_code, 0) << huge.output;
  EXPECT_NE(huge.output.find("PowerSGD compressed no gradient: at --powersgd-rank 1024"), std::string::npos)
      << huge.output;
  const std::string metrics = read_text(temp("powersgd_huge_out") + "/metrics.jsonl");
  EXPECT_NE(metrics.find("\"compression_rate\":1.0"), std::string::npos) << metrics;
}

TEST(TrainerCommHook, IsRefusedWithoutDdp) {
  auto alone = testing::run(with_hook(trainer("hook_alone"), "powersgd"), {kOneThread}, temp("hook_alone.log"), kDeadline);
  EXPECT_EQ(alone.exit_code, 2);
  EXPECT_NE(alone.output.find("--comm-hook powersgd sets how DistributedDataParallel reduces its buckets: run it under "
                              "a launcher"),
            std::string::npos)
      << alone.output;
  auto sharded_run = launch({"--nproc-per-node", "2", "--master-port", port()},
                            sharded(with_hook(trainer("hook_sharded"), "fp16"), "full"), "hook_sharded", {kOneThread});
  EXPECT_NE(sharded_run.exit_code, 0);
  EXPECT_NE(sharded_run.output.find("--comm-hook fp16 sets how DistributedDataParallel reduces its buckets, and "
                                    "--sharding full trains with FullyShardedDataParallel, which reduces its own"),
            std::string::npos) << sharded_run.output;
  EXPECT_EQ(sharded_run.output.find("run it under a launcher"), std::string::npos) << "it runs under one";
}

} // namespace
} // namespace lockstep
