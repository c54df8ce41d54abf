// lockstep-train --precision: bf16 and fp16 train under DataParallel,
// DistributedDataParallel and FullyShardedDataParallel, and fp16's
// GradScaler resumes from the checkpoint with the rest of the run.

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>
#include <torch/version.h>

#include <nlohmann/json.hpp>

#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;

std::vector<std::string> with_precision(std::vector<std::string> args, const std::string& precision) {
  args.insert(args.end(), {"--precision", precision});
  return args;
}

constexpr bool kCpuHalfAutocast = TORCH_VERSION_MAJOR >= 2; // AutocastGuard refuses it on 1.13 (torch_compat.h)

TEST(TrainerPrecision, Bf16AndFp16TrainUnderDataParallelDdpAndFsdp) {
  const double fp32 = test_accuracy(reference_run().output);
  ASSERT_GT(fp32, 50) << reference_run().output;
  for (const std::string precision : {"bf16", "fp16"}) {
    SCOPED_TRACE("--precision " + precision);
    const std::string name = "precision_" + precision;
    std::vector<testing::Process> runs;
    runs.push_back(testing::run(with_precision(trainer(name + "_dp"), precision), {kOneThread}, temp(name + "_dp.log"),
                                kDeadline));
    runs.push_back(launch({"--nproc-per-node", "2", "--master-port", port()},
                          with_precision(trainer(name + "_ddp"), precision), name + "_ddp", {kOneThread}));
    runs.push_back(launch({"--nproc-per-node", "2", "--master-port", port()},
                          with_precision(sharded(trainer(name + "_fsdp"), "full"), precision), name + "_fsdp",
                          {kOneThread}));
    for (const auto& p : runs) {
      if (precision == "fp16" && !kCpuHalfAutocast) {
        EXPECT_EQ(p.exit_code, 1) << p.output;
        EXPECT_NE(p.output.find("CPU autocast to float16 needs PyTorch 2.4 or later"), std::string::npos) << p.output;
        continue;
      }
      ASSERT_EQ(p.exit_code, 0) << p.output;
      EXPECT_NE(p.output.find(" in " + precision + "; "), std::string::npos) << "the summary does not say the precision\n"
                                                                             << p.output;
      EXPECT_NEAR(test_accuracy(p.output), fp32, 5.0) << p.output;
    }
  }
}

// The loss scale of each training record in OUT/metrics.jsonl, by step.
std::map<int64_t, double> loss_scales(const std::string& out_dir) {
  std::map<int64_t, double> scales;
  std::istringstream lines(read_text(out_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object() && record.value("kind", "") == "train" && record.contains("loss_scale")) {
      scales[record.at("step").get<int64_t>()] = record.at("loss_scale").get<double>();
    }
  }
  return scales;
}

// The scale doubles every 3 steps without overflow, so it moves all along.
// A rank fails after the checkpoint at step 20 (where the scale is not its
// initial one); the restart resumes the
// scale and growth tracker with the model: from there on it logs the
// uninterrupted run's scales, and ends bitwise where that run does.
TEST(TrainerPrecision, Fp16ResumesItsScaleFromTheCheckpoint) {
  if (!kCpuHalfAutocast) {
    GTEST_SKIP() << "CPU autocast to float16 needs PyTorch 2.4 (this is " << TORCH_VERSION << ")";
  }
  const auto job = [](const std::string& name, const std::string& checkpoint) {
    auto args = with_precision(trainer(name, checkpoint), "fp16");
    args.insert(args.end(), {"--loss-scale-growth-interval", "3", "--log-every", "2"});
    return args;
  };
  auto whole = launch({"--nproc-per-node", "2", "--master-port", port()}, job("fp16_whole", ""), "fp16_whole",
                      {kOneThread});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string checkpoint = temp("fp16.ckpt");
  auto resumed = launch({"--nproc-per-node", "2", "--master-port", port(), "--max-restarts", "1"},
                        job("fp16_resumed", checkpoint), "fp16_resumed", {"LOCKSTEP_FAULT=1:22", kOneThread});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + checkpoint + " at step 20"), std::string::npos) << resumed.output;
  const auto expected = loss_scales(temp("fp16_whole_out"));
  const auto got = loss_scales(temp("fp16_resumed_out"));
  ASSERT_EQ(expected.count(32), 1u) << read_text(temp("fp16_whole_out") + "/metrics.jsonl");
  std::set<double> values;
  for (const auto& entry : expected) {
    values.insert(entry.second);
  }
  EXPECT_GT(values.size(), 1u) << "the scale never moved, so this run tests nothing";
  for (int64_t step = 22; step <= 32; step += 2) {
    ASSERT_EQ(got.count(step), 1u) << "no record of step " << step;
    EXPECT_EQ(got.at(step), expected.at(step)) << "step " << step << ": the resumed run's loss scale";
  }
  EXPECT_EQ(final_hash(resumed.output), final_hash(whole.output)) << resumed.output;

  // A resume with another --loss-scale-growth-interval took the
  // checkpoint's without a word; this run's is said and used: at 1, the
  // scale can double at each step, so quadruple between two records.
  auto args = job("fp16_interval", checkpoint);
  args = with_flag(with_flag(args, "--loss-scale-growth-interval", "1"), "--epochs", "3");
  auto changed = launch({"--nproc-per-node", "2", "--master-port", port()}, args, "fp16_interval", {kOneThread});
  ASSERT_EQ(changed.exit_code, 0) << changed.output;
  EXPECT_NE(changed.output.find("; written with --loss-scale-growth-interval 3, and this run goes on with "
                                "--loss-scale-growth-interval 1\n"), std::string::npos)
      << changed.output;
  const auto scales = loss_scales(temp("fp16_interval_out"));
  bool quadrupled = false;
  for (const auto& [step, scale] : scales) {
    quadrupled = quadrupled || (scales.count(step + 2) == 1 && scales.at(step + 2) == 4 * scale);
  }
  EXPECT_TRUE(quadrupled) << read_text(temp("fp16_interval_out") + "/metrics.jsonl");
}

} // namespace
} // namespace lockstep
