// lockstep-train's checkpoints: resumed bitwise, refused clearly when they
// are damaged or foreign, and model files that move between the bare module,
// DataParallel and DistributedDataParallel.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/launch.h"
#include "support/modules.h"
#include "support/processes.h"

#include <examples/checkpoint.h>
#include <examples/idx.h>
#include <examples/models.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <zlib.h>

#include <functional>
#include <map>
#include <random>
#include <regex>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

TEST(Checkpoint, KilledSavesTemporariesAreRemovedAndAFinishedRunSaysSo) {
  const std::string checkpoint = temp("finished.ckpt");
  const std::string stale = checkpoint + ".tmp." + std::to_string(dead_pid());
  const std::string live = checkpoint + ".tmp." + std::to_string(getpid());
  std::ofstream(stale) << "x";
  std::ofstream(live) << "x";
  auto args = trainer("finished", checkpoint);
  auto p = testing::run(args, {}, temp("finished1.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(access(stale.c_str(), F_OK), 0) << "a killed save's temporary file is left";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << "a running save's temporary file was removed";
  // Run again: nothing is left to train, and it says so instead of "loss nan".
  auto again = testing::run(args, {}, temp("finished2.log"), kDeadline);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to train: the checkpoint " + checkpoint + " is of a finished run (2 of 2 epoch(s), "
                              "32 steps); raise --epochs"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("nan"), std::string::npos) << again.output;
  EXPECT_EQ(final_hash(again.output), final_hash(p.output)) << again.output;
}

TEST(Checkpoint, CorruptOrForeignFilesAreClearErrors) {
  const std::string garbage = temp("garbage.ckpt");
  std::ofstream(garbage) << "not a checkpoint";
  auto p = testing::run(trainer("garbage", garbage), {}, temp("garbage.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("checkpoint " + garbage + " is unreadable"), std::string::npos) << p.output;

  const std::string foreign = temp("foreign.ckpt");
  examples::ConvNet net;
  torch::save(net, foreign);
  p = testing::run(trainer("foreign", foreign), {}, temp("foreign.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("is not a lockstep-train checkpoint"), std::string::npos) << p.output;
}

TEST(Checkpoint, AnotherModelsShapesAreAClearError) {
  // Names match the trainer's model, one shape does not: LibTorch's load alone
  // would take it silently.
  const std::string path = temp("other_shapes.ckpt");
  examples::ConvNet net;
  net->fc2->weight.set_data(torch::zeros({5, 128}));
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  auto p = testing::run(trainer("other_shapes", path), {}, temp("other_shapes.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("does not match this model: 'fc2.weight' is [5, 128] float there but [10, 128] float here"),
            std::string::npos) << p.output;
}

TEST(Checkpoint, DamagedContentIsAClearError) {
  const std::string path = temp("damaged.ckpt");
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  // Flip bytes in the middle of the file: inside fc1.weight, most of its bytes.
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(0, std::ios::end);
  const auto size = static_cast<std::streamoff>(file.tellg());
  for (std::streamoff at = size / 2; at < size / 2 + 64; ++at) {
    file.seekg(at);
    const char c = static_cast<char>(file.get() ^ 0x5a);
    file.seekp(at);
    file.put(c);
  }
  file.close();
  auto p = testing::run(trainer("damaged", path), {}, temp("damaged.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_TRUE(p.output.find("checkpoint " + path + " is damaged") != std::string::npos ||
              p.output.find("checkpoint " + path + " is unreadable") != std::string::npos)
      << p.output;
}

TEST(Checkpoint, DataParallelRunResumesUnderTheLauncher) {
  const std::string checkpoint = temp("cross.ckpt");
  auto one_epoch = with_flag(trainer("cross1", checkpoint), "--epochs", "1");
  auto p = testing::run(one_epoch, {}, temp("cross1.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("DataParallel on [cpu,cpu]"), std::string::npos) << p.output;
  auto q = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("cross2", checkpoint), "cross2");
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("resumed from " + checkpoint + " at step 16 (epoch 2, batch 0); written with another world size"),
            std::string::npos) << q.output;
  EXPECT_NE(q.output.find("DistributedDataParallel over 2 ranks"), std::string::npos) << q.output;
}

TEST(Checkpoint, ModelFilesMoveBetweenBareDataParallelAndDdp) {
  const std::string path = temp("model.pt");
  examples::ConvNet bare, dp_net, ddp_net;
  DataParallel<examples::ConvNet> dp(dp_net, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  DistributedDataParallel<examples::ConvNet> ddp(ddp_net, ProcessGroup());

  torch::save(ddp, path); // DDP -> bare and DataParallel
  torch::load(bare, path);
  torch::load(dp, path);
  EXPECT_TRUE(testing::parameters_equal(*bare, *ddp_net));
  EXPECT_TRUE(testing::parameters_equal(*dp_net, *ddp_net));

  examples::ConvNet other;
  torch::save(other, path); // bare -> DDP
  torch::load(ddp, path);
  EXPECT_TRUE(testing::parameters_equal(*ddp_net, *other));

  examples::ConvNet third;
  DataParallel<examples::ConvNet> dp3(third, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  torch::save(dp3, path); // DataParallel -> DDP
  torch::load(ddp, path);
  EXPECT_TRUE(testing::parameters_equal(*ddp_net, *third));
}

} // namespace
} // namespace lockstep
