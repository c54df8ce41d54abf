// DistributedDataParallel with real processes: two ranks of
// lockstep_ddp_worker on localhost over a TCPStore, started the way
// torchrun starts them (environment variables).

#include "support/processes.h"
#include "support/scratch.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <unistd.h>

#include <string>
#include <vector>

namespace {

using lockstep::testing::Process;

// Starts `world` ranks of the worker on `scenario` and waits for them, at
// most `deadline`; ranks still running then are killed (exit_code -1).
std::vector<Process> run_ranks(const std::string& scenario, int world, std::chrono::seconds deadline,
                               const std::vector<std::string>& extra_env = {},
                               const std::string& worker = LOCKSTEP_DDP_WORKER,
                               const std::vector<std::string>& args = {}) {
  const int port = lockstep::testing::free_port();
  std::vector<Process> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env{"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                                 "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                 "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port), "OMP_NUM_THREADS=1"};
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<std::string> command{worker, scenario};
    command.insert(command.end(), args.begin(), args.end());
    ranks.push_back(lockstep::testing::start(
        command, env,
        lockstep::testing::scratch("ddp_" + scenario + "_" + std::to_string(r) + ".log")));
  }
  lockstep::testing::wait_all(ranks, deadline);
  return ranks;
}

std::string describe(const std::vector<Process>& results) {
  std::string text;
  for (size_t r = 0; r < results.size(); ++r) {
    text += "--- rank " + std::to_string(r) + " exit " + std::to_string(results[r].exit_code) + " after " +
        std::to_string(results[r].seconds) + " s\n" + results[r].output;
  }
  return text;
}

void expect_all_ok(const std::string& scenario, int world = 2, const std::vector<std::string>& env = {},
                   const std::string& worker = LOCKSTEP_DDP_WORKER, const std::vector<std::string>& args = {}) {
  auto results = run_ranks(scenario, world, std::chrono::seconds(120), env, worker, args);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << describe(results);
    EXPECT_NE(results[r].output.find("rank " + std::to_string(r) + ": OK"), std::string::npos) << describe(results);
  }
}

// FullyShardedDataParallel's checks (support/fsdp_checks.h) as processes over Gloo.
TEST(FsdpProcesses, EachStrategyMatchesOneProcessOnTwoAndThreeRanks) {
  expect_all_ok("equivalence", 2, {}, LOCKSTEP_FSDP_WORKER);
  expect_all_ok("equivalence", 3, {}, LOCKSTEP_FSDP_WORKER);
}

TEST(FsdpProcesses, ShardedCheckpointsMoveBetweenTwoAndThreeRanks) {
  for (auto sizes : {std::make_pair(2, 3), std::make_pair(3, 2)}) {
    const std::string dir = lockstep::testing::scratch("fsdp_processes_" + std::to_string(sizes.first));
    expect_all_ok("checkpoint_save", sizes.first, {}, LOCKSTEP_FSDP_WORKER, {dir});
    expect_all_ok("checkpoint_load", sizes.second, {}, LOCKSTEP_FSDP_WORKER, {dir});
  }
}

TEST(FsdpProcesses, NoSyncFrozenParametersAndAMismatchedModel) {
  expect_all_ok("no_sync", 2, {}, LOCKSTEP_FSDP_WORKER);
  expect_all_ok("frozen", 3, {}, LOCKSTEP_FSDP_WORKER);
  expect_all_ok("mismatch", 2, {}, LOCKSTEP_FSDP_WORKER);
}

// Two ranks on GPU 0 over Gloo (NCCL refuses two ranks on one device), as
// processes: ranks as threads of one process would share autograd's one
// thread for that device, where one rank's gradient hook, waiting for a
// collective, blocks the other rank's backward that would send its half.
TEST(FsdpProcesses, FullShardOverGlooWithCudaTensorsOnTwoRanks_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  expect_all_ok("cuda", 2, {}, LOCKSTEP_FSDP_WORKER);
}

TEST(FsdpProcesses, StateSavedOnTheCpuLoadsOntoTheGpu_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const std::string dir = lockstep::testing::scratch("fsdp_to_gpu");
  expect_all_ok("cuda_checkpoint", 2, {}, LOCKSTEP_FSDP_WORKER, {dir});
}

TEST(DdpProcesses, TwoRanksMatchOneProcessOnTheWholeBatch) {
  expect_all_ok("equivalence");
}

// Note [The same bits at any world size]: dropout and both optimizers,
// against one rank in each process.
TEST(DdpProcesses, DeterministicModeGivesOneRanksBitsAtTwoThreeAndFourRanks) {
  for (int world : {2, 3, 4}) {
    expect_all_ok("deterministic", world);
  }
  expect_all_ok("deterministic_indivisible", 2);
}

TEST(DdpProcesses, GradientAsBucketViewWithManyBuckets) {
  expect_all_ok("views");
}

// Issue "Wrapping must never change the answer": tests/ddp_worker_answers.cpp.
TEST(DdpProcesses, SharedParameterGetsItsWholeGradientInEveryMode) {
  expect_all_ok("shared");
}

TEST(DdpProcesses, NoSyncGradientsOfUnusedParametersAreReducedAndGloballyUnusedKept) {
  expect_all_ok("unused_no_sync", 2);
  expect_all_ok("unused_no_sync", 3);
}

TEST(DdpProcesses, SecondWrapperOfTheSameModuleIsRefused) {
  expect_all_ok("wrapped_twice");
}

TEST(DdpProcesses, RanksWithDifferentOptionsFailAtConstruction) {
  expect_all_ok("options_differ");
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

TEST(DdpProcesses, SyncBatchNormMatchesOneBatchNormOnUnevenBatches) {
  expect_all_ok("syncbn", 2);
  expect_all_ok("syncbn", 3);
}

TEST(DdpProcesses, SyncBatchNormOnCudaInputOverGloo_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  expect_all_ok("syncbn_cuda", 2); // both ranks on GPU 0: Gloo does not mind
}

TEST(DdpProcesses, SyncBatchNormInsideDdpMatchesOneProcess) {
  expect_all_ok("syncbn_ddp", 2);
}

TEST(DdpProcesses, JoinWithUnevenBatchesMatchesTheHandComputedSchedule) {
  expect_all_ok("join", 2); // 5 and 7 batches
  expect_all_ok("join", 3); // 5, 7 and 3
}

TEST(DdpProcesses, JoinDividingByTheRanksStillTraining) {
  expect_all_ok("join_by_training", 3);
}

TEST(DdpProcesses, JoinWhenRankZeroHasNoBatchAtAll) {
  expect_all_ok("join_empty", 3);
}

TEST(DdpProcesses, JoinThrowOnEarlyTerminationThrowsOnEveryRank) {
  expect_all_ok("join_throw", 2);
  expect_all_ok("join_throw", 3);
}

TEST(DdpProcesses, BucketsRebuiltInGradientOrderAndAgreed) {
  expect_all_ok("rebuild");
  expect_all_ok("rebuild_views");
}

TEST(DdpProcesses, StaticGraphSkipsTheCheckAndMatchesOneProcess) {
  expect_all_ok("static_graph");
}

TEST(DdpProcesses, StaticGraphBrokenIsAnErrorOnEveryRank) {
  expect_all_ok("static_graph_missing");
  expect_all_ok("static_graph_extra");
}

TEST(DdpProcesses, DebugDetailNamesBothRanksOnAShapeOrOperationMismatch) {
  expect_all_ok("desync_shape", 2, {"LOCKSTEP_DEBUG=detail"});
  expect_all_ok("desync_op", 3, {"LOCKSTEP_DEBUG=detail"});
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

// Over shared memory (Note [Collectives through shared memory]) a rank learns
// that its peer's process is gone within a wait's slice, not at the timeout.
TEST(DdpProcesses, PeerThatExitsMidJobFailsTheOtherAtOnceNamingIt) {
  auto results = run_ranks("peer_exits", 2, std::chrono::seconds(60));
  const auto all = describe(results);
  ASSERT_EQ(results[0].exit_code, 3) << all;
  EXPECT_LT(results[0].seconds, 10.0) << all;
  EXPECT_NE(results[0].output.find("rank 0 of 2: allreduce of bucket 0"), std::string::npos) << all;
  EXPECT_NE(results[0].output.find("Cause: rank 1 (process "), std::string::npos) << all;
  EXPECT_NE(results[0].output.find("on this host) exited before it reached this collective"), std::string::npos) << all;
  EXPECT_EQ(results[0].output.find("Exception raised from"), std::string::npos) << "a C++ backtrace in the error: " << all;
}

} // namespace
