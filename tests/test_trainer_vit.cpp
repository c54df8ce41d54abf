// lockstep-train --model vit: the Vision Transformer trains under DDP and
// FullShard (each block a unit), and --activation-checkpointing ends with
// the same parameters, to the bit (Note [Activation checkpointing]).

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

std::vector<std::string> vit(const std::string& marker) {
  auto args = trainer(marker);
  args.insert(args.end(), {"--model", "vit", "--dropout", "0.1"}); // checkpointing draws dropout's numbers again
  return args;
}

TEST(TrainerVit, CheckpointingEndsWithTheSameParametersUnderDdpAndFullShard) {
  for (const std::string sharding : {"", "full"}) {
    std::string hashes[2];
    for (bool checkpointed : {false, true}) {
      const std::string name = "vit" + sharding + (checkpointed ? "_checkpointed" : "");
      auto args = vit(name);
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
    EXPECT_EQ(hashes[0], hashes[1]) << "--sharding '" << sharding << "'";
  }
}

} // namespace
} // namespace lockstep
