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

// A tiny run, so that a flag the trainer would take quietly ends in seconds.
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

// Refusals after the command line parsed, but before training, exited 1
// where the parser's exit 2; PyTorch's names for the strategies are taken.
TEST(TrainerCommandLine, RefusalsBeforeTrainingHaveTheUsageExitCode) {
  expect_refused(train(tiny("sharding_alone"), {"--sharding", "full"}, "sharding_alone"),
                 "--sharding full runs FullyShardedDataParallel over ranks, one process each");
  expect_refused(train(tiny("hook_alone"), {"--comm-hook", "powersgd"}, "hook_alone"),
                 "--comm-hook powersgd sets how DistributedDataParallel reduces its buckets");
  for (const auto& [given, meant] : {std::make_pair("full-shard", "full"), std::make_pair("SHARD_GRAD_OP", "grad-op"),
                                     std::make_pair("no_shard", "none"), std::make_pair("shard-grad-op", "grad-op")}) {
    expect_refused(train(tiny(std::string("spelled_") + meant), {"--sharding", given}, std::string("spelled_") + meant),
                   std::string("--sharding ") + meant + " runs FullyShardedDataParallel over ranks");
  }
}

// Flags that could not take effect, and outputs that would overwrite one
// another, are refused before anything is loaded: --save and --checkpoint
// as one file (the model written last replaced the checkpoint), --save of a
// .safetensors name (a LibTorch archive under it, the real file at
// NAME.safetensors.safetensors), a batch no epoch can fill, and flags of
// another way of running.
TEST(TrainerCommandLine, OutputsThatCollideAndFlagsWithoutEffectAreRefused) {
  const std::string same = temp("same.pt");
  expect_refused(train(tiny("same"), {"--save", same, "--checkpoint", same}, "same"),
                 "--save and --checkpoint are one file, " + same);
  expect_refused(train(tiny("default_checkpoint"), {"--save", temp("default_checkpoint_out") + "/checkpoint.ckpt"},
                       "default_checkpoint"),
                 "--save and --checkpoint are one file");
  expect_refused(train(tiny("beside"), {"--save", temp("beside.pt"), "--checkpoint", temp("beside.safetensors")},
                       "beside"),
                 "--save's safetensors copy and --checkpoint are one file");
  expect_refused(train(tiny("st"), {"--save", temp("m.safetensors")}, "st"),
                 "--save " + temp("m.safetensors") + ": --save names the LibTorch archive");
  expect_refused(train(tiny("empty_epoch"), {"--deterministic", "--micro-batch-size", "16", "--batch-size", "128"},
                       "empty_epoch"),
                 "--deterministic trains whole batches only, and the 64 training samples fill no batch of "
                 "--batch-size 128: give a --batch-size of at most 64");
  expect_refused(train(tiny("cnn_dropout"), {"--dropout", "0.5"}, "cnn_dropout"),
                 "--dropout is the ViT's and the GPT's; the CNN has none");
  expect_refused(train(tiny("timeout_alone"), {"--timeout", "5"}, "timeout_alone"),
                 "--timeout is how long a rank waits for the others");
  expect_refused(train(tiny("replicas_dropout"), {"--model", "vit", "--dropout", "0.1", "--activation-checkpointing"},
                       "replicas_dropout"),
                 "--activation-checkpointing with --dropout on 2 DataParallel CPU replicas (--replicas)");
}

// Notes at the start of a run that would otherwise mislead: a warmup
// longer than the run, PowerSGD's flags without its hook, fp16 on a CPU.
TEST(TrainerCommandLine, SettingsThatCannotTakeEffectAreSaid) {
  auto p = train(tiny("notes"), {"--powersgd-rank", "8", "--precision", "fp16"}, "notes");
  EXPECT_NE(p.output.find("lockstep-train: --powersgd-rank has no effect without --comm-hook powersgd (here "
                          "--comm-hook none)"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("lockstep-train: note: --precision fp16 on a CPU is slow"), std::string::npos) << p.output;
  auto q = train(tiny("warmup"), {}, "warmup");
  EXPECT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("lockstep-train: --warmup-steps 100 is more than the run's 2 steps (1 epoch(s) of 2), so the "
                          "learning rate never reaches --lr 0.1: it ends at 0.002."), std::string::npos) << q.output;
}

// A loss that became NaN or infinite ended every run with exit code 1 and
// "[json.exception.type_error.302] type must be number, but is null" from
// the curves. The run finishes, and says from which step.
TEST(TrainerCommandLine, ARunWhoseLossDivergesFinishesAndSaysWhen) {
  auto p = train(tiny("diverged"), {"--lr", "1e30", "--warmup-steps", "0"}, "diverged");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-train: the training loss stopped being finite (NaN or infinite) by step 2"),
            std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("json.exception"), std::string::npos) << p.output;
}

// A resumed run's summary counted the steps of the run it resumed, and a
// change of --precision, --lr or --warmup-steps went unsaid.
TEST(TrainerCommandLine, AResumedRunCountsItsOwnStepsAndSaysWhatChanged) {
  const std::string checkpoint = temp("counted.ckpt");
  auto first = train(tiny("counted"), {"--checkpoint", checkpoint}, "counted");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto second = train(with_flag(tiny("counted2"), "--epochs", "2"), {"--checkpoint", checkpoint, "--precision", "bf16"},
                      "counted2");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("2 epoch(s), 2 steps (4 in all) in"), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("; written with --precision fp32, and this run goes on with --precision bf16\n"),
            std::string::npos) << second.output;
  // Another --lr or --warmup-steps went unsaid.
  auto third = train(with_flag(tiny("counted3"), "--epochs", "3"),
                     {"--checkpoint", checkpoint, "--precision", "bf16", "--lr", "0.05", "--warmup-steps", "1"},
                     "counted3");
  ASSERT_EQ(third.exit_code, 0) << third.output;
  EXPECT_NE(third.output.find("; written with --lr 0.1 --warmup-steps 100, and this run goes on with --lr 0.05 "
                              "--warmup-steps 1\n"), std::string::npos) << third.output;
}

// A place nothing can be written to that access() passes (a pseudo file
// system, as root) failed after training with "open file failed", naming
// no path; then it was refused with advice to create /proc.
TEST(TrainerPaths, ASaveWhereNothingCanBeWrittenIsRefusedBeforeAnything) {
  const auto p = train(tiny("proc_save"), {"--checkpoint", "/proc/lockstep-x.ckpt"}, "proc_save");
  expect_refused(p, "--checkpoint /proc/lockstep-x.ckpt: cannot write into /proc/: no file can be made there (");
  EXPECT_EQ(p.output.find("create the folder"), std::string::npos) << p.output;
  expect_refused(train(tiny("proc_save2"), {"--save", "/proc/lockstep-model.pt"}, "proc_save2"),
                 "--save /proc/lockstep-model.pt: cannot write into /proc/");
}

// --export-mnist wrote MNIST's counts and exited, taking --train-samples,
// --epochs or --out without a word; --loss-scale-growth-interval without
// fp16 was as quiet, and so was --threads under --deterministic.
TEST(TrainerCommandLine, FlagsThatWouldHaveNoEffectAreSaid) {
  const std::string folder = temp("export_ignores");
  ::mkdir(folder.c_str(), 0755);
  const auto p = train({LOCKSTEP_TRAIN, "--export-mnist", folder}, {"--train-samples", "100", "--epochs", "5"},
                       "export_ignores");
  expect_refused(p, "--export-mnist writes the synthetic dataset (MNIST's 60000/10000 samples, by --seed) and exits, "
                    "so --train-samples, --epochs would have no effect");
  EXPECT_NE(access((folder + "/train-images-idx3-ubyte").c_str(), F_OK), 0) << "it wrote before refusing";
  const auto q = train(tiny("interval_alone"), {"--loss-scale-growth-interval", "5"}, "interval_alone");
  EXPECT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("lockstep-train: --loss-scale-growth-interval has no effect without --precision fp16 (here "
                          "--precision fp32)"), std::string::npos) << q.output;
  // --threads changes --deterministic's bits: said, where it went unsaid.
  const auto r = train(tiny("deterministic_threads"), {"--deterministic", "--micro-batch-size", "16", "--threads", "2"},
                       "deterministic_threads");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --threads 2 with --deterministic: some kernels split their sums by thread"),
            std::string::npos) << r.output;
}

// The version is CMake's project(VERSION), in one place (<lockstep/version.h>).
TEST(TrainerCommandLine, BothToolsPrintTheVersion) {
  for (const std::string tool : {LOCKSTEP_TRAIN, LOCKSTEP_RUN}) {
    auto p = testing::run({tool, "--version"}, {}, temp("version.log"), kDeadline);
    EXPECT_EQ(p.exit_code, 0) << p.output;
    const std::string name = tool.substr(tool.find_last_of('/') + 1);
    EXPECT_EQ(p.output, name + " " + LOCKSTEP_VERSION + "\n");
  }
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
