// lockstep-train's and lockstep-run's refusals: one style and one exit code,
// the flag and path named, and every path checked before anything runs.

#include <lockstep/lockstep.h>

#include "support/launch.h"
#include "support/processes.h"

#include <examples/data.h>

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

constexpr int kUsageExit = 2;

// A tiny run, so that a flag the old trainer took quietly ends in seconds.
std::vector<std::string> tiny(const std::string& name) {
  return {LOCKSTEP_TRAIN, "--synthetic", "--train-samples", "64", "--test-samples", "16", "--batch-size", "32",
          "--epochs", "1", "--out", temp(name + "_out")};
}

Process train(std::vector<std::string> args, const std::vector<std::string>& extra, const std::string& name) {
  args.insert(args.end(), extra.begin(), extra.end());
  return testing::run(args, {}, temp(name + ".log"), kDeadline);
}

void expect_refused(const Process& p, const std::string& message) {
  EXPECT_EQ(p.exit_code, kUsageExit) << p.output;
  EXPECT_EQ(p.output.rfind("lockstep-train: " + message, 0), 0u) << "expected it to start with: " << message << "\n"
                                                                  << p.output;
  EXPECT_NE(p.output.find("Run 'lockstep-train --help' for usage."), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("epoch 1/"), std::string::npos) << "trained before refusing: " << p.output;
}

TEST(TrainerCommandLine, ParserRefusalsHaveThePrefixAndTheUsageExitCode) {
  expect_refused(train(tiny("zero"), {"--batch-size", "0"}, "zero"), "--batch-size: must be greater than 0, got 0");
  expect_refused(train(tiny("bogus"), {"--bogus"}, "bogus"), "The following argument was not expected: --bogus");
  expect_refused(train(tiny("word"), {"--epochs", "two"}, "word"), "--epochs");
}

TEST(TrainerCommandLine, OutOfRangeNumbersAreRefusedNamingTheFlag) {
  expect_refused(train(tiny("huge_batch"), {"--batch-size", "18446744073709551617"}, "huge_batch"),
                 "--batch-size: must be a whole number from 1 to");
  expect_refused(train(tiny("huge_eval"), {"--eval-every", "18446744073709551617"}, "huge_eval"),
                 "--eval-every: must be a whole number from 0 to");
  expect_refused(train(tiny("huge_epochs"), {"--epochs", "99999999999"}, "huge_epochs"),
                 "--epochs: must be a whole number from 1 to");
  expect_refused(train(tiny("huge_seed"), {"--seed", "18446744073709551617"}, "huge_seed"),
                 "--seed: must be a whole number from 0 to");
  expect_refused(train(tiny("huge_samples"), {"--train-samples", "1000000000000"}, "huge_samples"),
                 "--train-samples 1000000000000 needs");
}

TEST(TrainerCommandLine, MoreSamplesThanTheFilesHoldIsRefused) {
  const std::string dir = temp("few_rows");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  torch::manual_seed(0);
  examples::Samples rows{torch::randn({60, 1, 28, 28}), torch::randint(0, 10, {60}, torch::kLong)};
  examples::write_idx(rows, dir, "train");
  examples::write_idx(rows, dir, "t10k");
  auto args = std::vector<std::string>{LOCKSTEP_TRAIN, "--data", dir, "--batch-size", "20", "--epochs", "1", "--out",
                                       dir + "/out"};
  auto p = train(args, {"--train-samples", "100"}, "few_rows_train");
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("lockstep-train: --train-samples 100 is more than the 60 training samples in " + dir),
            std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("epoch 1/"), std::string::npos) << p.output;
  auto q = train(args, {"--test-samples", "61"}, "few_rows_test");
  EXPECT_EQ(q.exit_code, 1) << q.output;
  EXPECT_NE(q.output.find("lockstep-train: --test-samples 61 is more than the 60 test samples in " + dir),
            std::string::npos) << q.output;
}

TEST(TrainerPaths, CheckpointOrSaveNamingAFolderIsRefusedBeforeAnything) {
  const std::string folder = temp("a_folder");
  ASSERT_EQ(mkdir(folder.c_str(), 0755), 0);
  for (const std::string flag : {"--checkpoint", "--save"}) {
    const std::string out = temp("folder_out" + flag.substr(1));
    auto args = tiny("folder" + flag.substr(1));
    args = with_flag(args, "--out", out);
    auto p = train(args, {flag, folder}, "folder" + flag.substr(1));
    expect_refused(p, flag + " " + folder + ": is a folder; name a file");
    EXPECT_NE(access(out.c_str(), F_OK), 0) << "left an output folder behind";
  }
}

TEST(LauncherPaths, TimelineAtAnUnwritablePathIsRefusedBeforeAnything) {
  const std::string path = temp("no_such_folder") + "/timeline.json";
  auto p = launch({"--timeline", path, "--master-port", port()}, {"/bin/echo", "job-started"}, "timeline_unwritable");
  EXPECT_EQ(p.exit_code, kUsageExit) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: --timeline " + path + ": cannot write it (No such file or directory)"),
            std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("job-started"), std::string::npos) << "ran before refusing: " << p.output;
}

TEST(LauncherPaths, UnwritableLogDirIsRefusedAndAMissingOneIsCreated) {
  // /proc/self: a folder no one can create files in, root included.
  auto p = launch({"--log-dir", "/proc/self", "--master-port", port()}, {"/bin/echo", "job-started"}, "logs_unwritable");
  EXPECT_EQ(p.exit_code, kUsageExit) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: --log-dir /proc/self: cannot write rank_0.log there ("), std::string::npos)
      << p.output;
  EXPECT_EQ(p.output.find("job-started"), std::string::npos) << "ran before refusing: " << p.output;

  const std::string nested = temp("new_logs") + "/a/b";
  auto q = launch({"--log-dir", nested, "--master-port", port()}, {"/bin/echo", "job-started"}, "logs_created");
  EXPECT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(read_text(nested + "/rank_0.log").find("job-started"), std::string::npos) << q.output;
}

TEST(Launcher, HugeStderrLineIsCutInTheFailureSummary) {
  const std::string script = "head -c 10485760 /dev/zero | tr '\\0' x >&2; echo >&2; echo last words >&2; exit 3";
  auto p = launch({"--master-port", port()}, {"/bin/sh", "-c", script}, "huge_line");
  EXPECT_EQ(p.exit_code, 1) << p.output.substr(0, 2000);
  const auto summary = p.output.find("lockstep-run: last lines of rank 0's stderr:");
  ASSERT_NE(summary, std::string::npos) << p.output.substr(p.output.size() - std::min<size_t>(p.output.size(), 2000));
  const std::string tail = p.output.substr(summary);
  EXPECT_LT(tail.size(), 10000u) << "the summary repeats the line whole";
  EXPECT_NE(tail.find("... [cut: 10485760 bytes]"), std::string::npos) << tail.substr(0, 2000);
  EXPECT_NE(tail.find("last words"), std::string::npos) << tail.substr(0, 2000);
}

} // namespace
} // namespace lockstep
