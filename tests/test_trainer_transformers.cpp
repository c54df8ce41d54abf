// lockstep-train's transformers. --model vit and --model gpt train under
// DDP and FullShard (each block a unit), and --activation-checkpointing ends
// with the same parameters, to the bit (Note [Activation checkpointing]).
// The byte-level GPT learns a text and reports its held-out perplexity,
// reads Debian's fortunes by default, and refuses the image models' flags.

#include "support/launch.h"
#include "support/processes.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;

// A text of 40 KB that repeats a few sentences in an order of its own: easy
// to learn, never one period.
std::string learnable_text() {
  static const std::string path = [] {
    const char* sentences[] = {"the quick brown fox jumps over the lazy dog. ", "a stitch in time saves nine. ",
                               "all that glitters is not gold. ", "many hands make light work. "};
    std::string text;
    for (unsigned i = 0; text.size() < 40000; ++i) {
      text += sentences[(i * i + i / 3) % 4];
    }
    const std::string file = temp("gpt_text.txt");
    std::ofstream(file) << text;
    return file;
  }();
  return path;
}

// `samples` training sequences of 32 bytes (24 test ones), batch 32, at a
// constant learning rate of 0.001.
std::vector<std::string> gpt(const std::string& marker, const std::string& samples = "256",
                             const std::string& epochs = "2") {
  return {LOCKSTEP_TRAIN, "--model", "gpt", "--text", learnable_text(), "--context", "32", "--train-samples", samples,
          "--test-samples", "24", "--batch-size", "32", "--epochs", epochs, "--warmup-steps", "0", "--lr", "0.001",
          "--schedule", "constant", "--save", temp(marker + ".pt"), "--out", temp(marker + "_out")};
}

std::vector<nlohmann::json> records(const std::string& dir, const std::string& kind) {
  std::vector<nlohmann::json> found;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto r = nlohmann::json::parse(line);
    if (r.value("kind", "") == kind) {
      found.push_back(r);
    }
  }
  return found;
}

TEST(TrainerGpt, LearnsTheTextAndReportsItsHeldOutPerplexity) {
  // 96 steps.
  const auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, gpt("gpt", "1024", "3"), "gpt");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.output, m, std::regex("test accuracy [0-9.]+% \\(([0-9]+) of ([0-9]+) test tokens, "
                                                        "over 2 rank\\(s\\)\\)"))) << p.output;
  EXPECT_EQ(m[2].str(), "768") << "24 held-out sequences of 32 tokens";
  const auto epochs = records(temp("gpt_out"), "epoch");
  ASSERT_EQ(epochs.size(), 3u);
  for (const auto& e : epochs) {
    EXPECT_DOUBLE_EQ(e["test_perplexity"].get<double>(), std::exp(e["test_loss"].get<double>()));
    EXPECT_GT(e["tokens_per_second"].get<double>(), 0);
    EXPECT_EQ(e.count("samples_per_second"), 0u);
  }
  // A guess from the bytes' frequencies alone scores about 19 on this text;
  // the model learns the words (1.5 here).
  const double last = epochs[2]["test_perplexity"].get<double>();
  EXPECT_LT(last, epochs[0]["test_perplexity"].get<double>());
  EXPECT_LT(last, 4.0) << p.output;
  EXPECT_NE(p.output.find("(perplexity "), std::string::npos);
  EXPECT_NE(p.output.find("tokens/s over all 2 rank(s)"), std::string::npos) << p.output;
  EXPECT_TRUE(std::regex_search(p.output, std::regex("final parameters fnv1a64=[0-9a-f]{16}, the same on all 2 "
                                                     "ranks"))) << p.output;
}

TEST(TrainerVit, CheckpointingEndsWithTheSameParametersUnderDdpAndFullShard) {
  expect_checkpointing_keeps_the_bits("vit", [](const std::string& name) {
    auto args = trainer(name);
    args.insert(args.end(), {"--model", "vit"});
    return args;
  });
}

TEST(TrainerGpt, CheckpointingEndsWithTheSameParametersUnderDdpAndFullShard) {
  expect_checkpointing_keeps_the_bits("gpt", [](const std::string& name) { return gpt(name); });
}

// Deterministic mode on a model with token inputs, an embedding and dropout:
// 1 rank and 2 end with the same bits.
TEST(TrainerGpt, DeterministicModeGivesTheSameBitsAtOneAndTwoRanks) {
  std::string hashes[2];
  for (int ranks : {1, 2}) {
    const std::string name = "gpt_deterministic" + std::to_string(ranks);
    auto args = gpt(name, "256", "1");
    args.insert(args.end(), {"--deterministic", "--micro-batch-size", "8", "--dropout", "0.1"});
    const auto p = launch({"--nproc-per-node", std::to_string(ranks), "--master-port", port()}, args, name);
    ASSERT_EQ(p.exit_code, 0) << p.output;
    hashes[ranks - 1] = final_hash(p.output);
  }
  EXPECT_FALSE(hashes[0].empty());
  EXPECT_EQ(hashes[0], hashes[1]);
}

// A sharded checkpoint of another --context failed on 'wpe''s shape without
// naming the flag (a whole one: GptModel.WeightsOfAnotherContextNameTheFlag).
TEST(TrainerGpt, AShardedResumeWithAnotherContextNamesTheFlag) {
  const std::string checkpoint = temp("gpt_context.ckpt");
  auto args = testing::jobs::sharded(gpt("gpt_context", "64", "1"), "full");
  args.insert(args.end(), {"--checkpoint", checkpoint});
  const auto first = launch({"--nproc-per-node", "2", "--master-port", port()}, args, "gpt_context");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto longer = launch({"--nproc-per-node", "2", "--master-port", port()},
                             with_flag(with_flag(args, "--context", "48"), "--epochs", "2"), "gpt_context48");
  EXPECT_NE(longer.exit_code, 0);
  EXPECT_NE(longer.output.find("size mismatch for wpe: the checkpoint's is [32, 128], the model's [48, 128]."),
            std::string::npos) << longer.output;
  EXPECT_NE(longer.output.find("'wpe', the GPT's position table, has a row per token of --context: give the --context "
                               "the checkpoint was written with."), std::string::npos) << longer.output;
}

TEST(TrainerGpt, TrainsOnDebiansFortunesByDefault) {
  const auto p = testing::run({LOCKSTEP_TRAIN, "--model", "gpt", "--train-samples", "32", "--test-samples", "16",
                               "--batch-size", "16", "--epochs", "1", "--replicas", "1", "--out", temp("fortunes_out")},
                              {}, temp("fortunes.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("the text of Debian's fortunes in /usr/share/games/fortunes ("), std::string::npos)
      << p.output;
  EXPECT_NE(p.output.find("of 2048 test tokens"), std::string::npos) << p.output;
}

TEST(TrainerGpt, FlagsOfAnotherModelAreRefused) {
  struct Case {
    std::vector<std::string> flags;
    std::string says;
  };
  const std::vector<Case> cases{
      {{"--model", "gpt", "--synthetic"}, "--synthetic is for the image models; --model gpt trains on text"},
      {{"--text", learnable_text()}, "--text sets the language model's text; add --model gpt."},
      {{"--model", "gpt", "--momentum", "0.5"}, "--momentum is SGD's; AdamW has its own betas"},
      {{"--activation-checkpointing"}, "--activation-checkpointing checkpoints a transformer's blocks; add --model "
                                       "vit or --model gpt."}};
  for (const auto& c : cases) {
    auto args = std::vector<std::string>{LOCKSTEP_TRAIN, "--out", temp("refused_out")};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const auto p = testing::run(args, {}, temp("refused.log"), kDeadline);
    EXPECT_EQ(p.exit_code, 2) << p.output;
    EXPECT_NE(p.output.find(c.says), std::string::npos) << p.output;
  }
}

} // namespace
} // namespace lockstep
