// lockstep-train's answers must not depend on how a run was cut up: resumed
// at another batch size, with another seed, over other data, or with a last
// batch of one row per rank.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/launch.h"
#include "support/processes.h"

#include <examples/checkpoint.h>
#include <examples/models.h>
#include <examples/sampling.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <sstream>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

// The records of `kind` in OUT/metrics.jsonl.
std::vector<nlohmann::json> records(const std::string& out, const std::string& kind) {
  std::vector<nlohmann::json> found;
  std::istringstream lines(read_text(out + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto record = nlohmann::json::parse(line);
    if (record.at("kind") == kind) {
      found.push_back(record);
    }
  }
  return found;
}

// Every row of an epoch's batches, in order, over `plan.world_size` ranks.
std::vector<int64_t> epoch_rows(examples::BatchPlan plan, int64_t epoch) {
  std::vector<int64_t> rows;
  for (int r = 0; r < plan.world_size; ++r) {
    plan.rank = r;
    for (const auto& b : examples::rank_batches(plan, epoch, 0)) {
      rows.insert(rows.end(), b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
    }
  }
  return rows;
}

TEST(TrainerOrder, SeedChangesTheOrderUnderDdpAndTheRanksShareItDisjointly) {
  const examples::BatchPlan plan{/*samples=*/100, /*batch_size=*/10, /*world_size=*/2, /*rank=*/0, /*seed=*/1};
  auto other_seed = plan;
  other_seed.seed = 2;
  EXPECT_EQ(epoch_rows(plan, 0), epoch_rows(plan, 0));
  EXPECT_NE(epoch_rows(plan, 0), epoch_rows(other_seed, 0)) << "--seed does not change the order";
  EXPECT_NE(epoch_rows(plan, 0), epoch_rows(plan, 1)) << "two epochs have one order";
  for (const auto& p : {plan, other_seed}) {
    const auto rows = epoch_rows(p, 0);
    EXPECT_EQ(rows.size(), 100u);
    EXPECT_EQ(std::set<int64_t>(rows.begin(), rows.end()).size(), 100u) << "a row is trained twice";
  }
}

TEST(TrainerOrder, TheRestOfAnEpochJoinsItsLastWholeBatch) {
  // 103 rows in batches of 10 over 2 ranks: 9 batches of 10, then 12 of the
  // 13 left (a multiple of 2), never a batch of 1 row per rank.
  const examples::BatchPlan plan{/*samples=*/103, /*batch_size=*/10, /*world_size=*/2, /*rank=*/1, /*seed=*/1};
  const auto batches = examples::rank_batches(plan, 0, 0);
  ASSERT_EQ(batches.size(), 10u);
  for (size_t i = 0; i + 1 < batches.size(); ++i) {
    EXPECT_EQ(batches[i].size(0), 5) << "batch " << i;
  }
  EXPECT_EQ(batches.back().size(0), 6);
  EXPECT_EQ(epoch_rows(plan, 0).size(), 102u);
}

TEST(TrainerResume, AnotherBatchSizeTrainsEachSampleOnceAndKeepsTheSchedule) {
  // Stopped after step 4 at batch 128 (512 of 1024 samples), resumed at 64:
  // 8 more steps, not 12 (batch 4 of 64 onwards re-trained 256 samples).
  const std::string checkpoint = temp("rebatch.ckpt");
  const std::string out = temp("rebatch_out");
  auto args = with_flag(with_flag(with_flag(trainer("rebatch", checkpoint), "--epochs", "1"), "--batch-size", "128"),
                        "--out", out);
  args.insert(args.end(), {"--warmup-steps", "8", "--schedule", "cosine"});
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, args, "rebatch1", {kOneThread, "LOCKSTEP_FAULT=0:5"});
  ASSERT_NE(p.exit_code, 0) << p.output;
  auto q = launch({"--nproc-per-node", "2", "--master-port", port()}, with_flag(args, "--batch-size", "64"), "rebatch2",
                  {kOneThread});
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("resumed from " + checkpoint + " at step 4 (epoch 1, sample 512 of 1024)"), std::string::npos)
      << q.output;
  EXPECT_NE(q.output.find("1 epoch(s), 8 steps (12 in all)"), std::string::npos) << q.output;
  const auto epochs = records(out, "epoch");
  ASSERT_EQ(epochs.size(), 1u);
  EXPECT_EQ(epochs[0].value("samples", int64_t{-1}), 1024) << epochs[0];
  // The schedule ends where an uninterrupted epoch at 64 ends: its last
  // step is 15 of 16, 7 of the cosine's 8 (4 steps at 128 counted as 4 at
  // 64 would leave it at step 11, 3 of 8).
  const double cosine_at_7_of_8 = 0.1 * 0.5 * (1 + std::cos(M_PI * 7 / 8));
  EXPECT_NEAR(epochs[0].value("lr", -1.0), cosine_at_7_of_8, 1e-9) << epochs[0];
}

// `args` with `flag` set to `value`: replaced if there, else added.
std::vector<std::string> set_flag(std::vector<std::string> args, const std::string& flag, const std::string& value) {
  if (std::find(args.begin(), args.end(), flag) != args.end()) {
    return with_flag(args, flag, value);
  }
  args.insert(args.end(), {flag, value});
  return args;
}

TEST(TrainerResume, OtherDataIsSaidOnResuming) {
  const std::string said = "written over other training data";
  struct Case {
    std::string flag, value;
  };
  // Each case: one epoch of 256 synthetic samples, then a second with one flag changed.
  for (const auto& c : {Case{"--epochs", "2"}, Case{"--train-samples", "512"}, Case{"--seed", "2"}}) {
    const std::string name = "other_data" + c.flag.substr(1);
    const std::string checkpoint = temp(name + ".ckpt");
    auto first = with_flag(with_flag(trainer(name, checkpoint), "--epochs", "1"), "--train-samples", "256");
    auto p = testing::run(first, {}, temp(name + "1.log"), kDeadline);
    ASSERT_EQ(p.exit_code, 0) << p.output;
    auto q = testing::run(set_flag(with_flag(first, "--epochs", "2"), c.flag, c.value), {}, temp(name + "2.log"),
                          kDeadline);
    EXPECT_EQ(q.exit_code, 0) << q.output;
    const bool other_data = c.flag != "--epochs";
    EXPECT_EQ(q.output.find(said) != std::string::npos, other_data) << c.flag << ": " << q.output;
  }
}

// LibTorch 2.x's optimizer load restores the saved options: a run resumed
// with another --momentum went on with the checkpoint's, silently.
TEST(TrainerResume, ANewMomentumTakesEffectOnResuming) {
  std::map<std::string, std::string> hashes;
  for (const std::string momentum : {"0.9", "0"}) {
    const std::string name = "momentum" + momentum;
    const std::string checkpoint = temp(name + ".ckpt");
    auto first = with_flag(with_flag(trainer(name, checkpoint), "--epochs", "1"), "--train-samples", "256");
    auto p = testing::run(set_flag(first, "--momentum", "0.9"), {}, temp(name + "1.log"), kDeadline);
    ASSERT_EQ(p.exit_code, 0) << p.output;
    auto q = testing::run(set_flag(with_flag(first, "--epochs", "2"), "--momentum", momentum), {}, temp(name + "2.log"),
                          kDeadline);
    ASSERT_EQ(q.exit_code, 0) << q.output;
    ASSERT_NE(q.output.find("resumed from " + checkpoint), std::string::npos) << q.output;
    hashes[momentum] = final_hash(q.output);
  }
  EXPECT_FALSE(hashes["0"].empty());
  EXPECT_NE(hashes["0"], hashes["0.9"]) << "the run resumed with --momentum 0 went on with the checkpoint's 0.9";
}

TEST(TrainerLastBatch, OneRowPerRankLeftOverDoesNotThrowTheModelOff) {
  // 1293 = 10 * 129 + 3: a last batch of one row on each of 3 ranks. It
  // threw the model off (39.3% test accuracy; 89.7% without those 3 rows);
  // it joins the batch before instead.
  const std::string out = temp("last_row_out");
  auto p = launch({"--nproc-per-node", "3", "--master-port", port()},
                  {LOCKSTEP_TRAIN, "--synthetic", "--train-samples", "1293", "--test-samples", "600", "--batch-size",
                   "129", "--epochs", "1", "--warmup-steps", "10", "--out", out},
                  "last_row", {kOneThread});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("1 epoch(s), 10 steps"), std::string::npos) << p.output;
  const auto epochs = records(out, "epoch");
  ASSERT_EQ(epochs.size(), 1u);
  EXPECT_EQ(epochs[0].value("samples", int64_t{-1}), 1293) << epochs[0];
  EXPECT_GT(epochs[0].at("test_accuracy").get<double>(), 0.7) << epochs[0];
  EXPECT_LT(epochs[0].at("test_loss").get<double>(), 1.0) << epochs[0];
}

// A checkpoint of the format before the position was kept in samples.
void write_old_checkpoint(const std::string& path, int64_t batch_in_epoch) {
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
  net->save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("format", torch::tensor(int64_t{2}));
  archive.write("epoch", torch::tensor(int64_t{1}));
  archive.write("batch_in_epoch", torch::tensor(batch_in_epoch));
  archive.write("step", torch::tensor(int64_t{20}));
  archive.write("world_size", torch::tensor(int64_t{2}));
  archive.write("model_hash", examples::hash_tensor(examples::content_hash(examples::model_tensors(*net))));
  archive.write("optimizer_hash", examples::hash_tensor(examples::optimizer_hash(optimizer)));
  examples::write_checkpoint_file(path, archive);
}

TEST(Checkpoint, OldFormatResumesAtAnEpochsStartAndIsRefusedMidEpoch) {
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  examples::TrainingState state;
  const std::string start = temp("old_start.ckpt");
  write_old_checkpoint(start, 0);
  EXPECT_TRUE(examples::load_checkpoint(start, *net, optimizer, state));
  EXPECT_EQ(state.epoch, 1);
  EXPECT_EQ(state.step, 20);
  const std::string middle = temp("old_middle.ckpt");
  write_old_checkpoint(middle, 3);
  EXPECT_ERROR_SAYS(examples::load_checkpoint(middle, *net, optimizer, state),
                    "stands at batch 3 of epoch 2, and that format does not record the batch size");
}

} // namespace
} // namespace lockstep
