// lockstep-train --model gpt's model and data (examples/models.h,
// examples/text_data.h): causal attention, tied embeddings, and the text
// cut into training and held-out sequences.

#include <examples/checkpoint.h>
#include <examples/models.h>
#include <examples/scoring.h>
#include <examples/text_data.h>
#include <examples/weights.h>

#include "support/errors.h"
#include "support/scratch.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace lockstep {
namespace {

using examples::Gpt;

// eval() reaches the chosen model's own dropout (the embeddings'), not only
// its blocks', which are the trainer model's children: in eval mode two
// forwards give the same bits.
TEST(GptModel, TheTrainerModelsEvalTurnsEveryDropoutOff) {
  for (const std::string kind : {"vit", "gpt"}) {
    SCOPED_TRACE(kind);
    torch::manual_seed(0);
    examples::TrainerNet net(kind, /*checkpointed=*/false, /*dropout=*/0.5, /*context=*/16);
    const auto x = kind == "vit" ? torch::randn({2, 1, 28, 28}) : torch::randint(0, 256, {2, 16}, torch::kLong);
    net->eval();
    EXPECT_TRUE(net->forward(x).equal(net->forward(x)));
    net->train();
    EXPECT_FALSE(net->forward(x).equal(net->forward(x))) << "dropout is off in training: the test shows nothing";
  }
}

// A clone computes what the original does: DataParallel's replicas are
// clones, and a clone's blocks are the original's, copied into the list
// its reset() made, not the fresh ones reset() made.
TEST(GptModel, ACloneOfTheTrainerModelComputesTheSame) {
  for (const std::string kind : {"vit", "gpt"}) {
    SCOPED_TRACE(kind);
    torch::manual_seed(0);
    examples::TrainerNet net(kind, /*checkpointed=*/false, /*dropout=*/0.0, /*context=*/16);
    net->eval();
    auto copy = std::dynamic_pointer_cast<examples::TrainerNetImpl>(net->clone());
    ASSERT_TRUE(copy);
    copy->eval();
    const auto x = kind == "vit" ? torch::randn({2, 1, 28, 28}) : torch::randint(0, 256, {2, 16}, torch::kLong);
    EXPECT_TRUE(copy->forward(x).equal(net->forward(x)));
  }
}

TEST(GptModel, APositionSeesNoLaterToken) {
  torch::manual_seed(0);
  Gpt gpt(256, 16, 32, 2, 4, /*dropout=*/0.0);
  auto tokens = torch::randint(0, 256, {2, 16}, torch::kLong);
  auto changed = tokens.clone();
  changed.select(1, 9).fill_(7).add_(tokens.select(1, 9)).remainder_(256); // another token at position 9
  ASSERT_FALSE(changed.equal(tokens));
  auto before = gpt->forward(tokens);
  auto after = gpt->forward(changed);
  EXPECT_TRUE(before.narrow(1, 0, 9).equal(after.narrow(1, 0, 9)));      // positions 0-8: the same bits
  EXPECT_FALSE(before.narrow(1, 9, 7).allclose(after.narrow(1, 9, 7)));   // 9 onwards see the change
  EXPECT_EQ(before.sizes(), (std::vector<int64_t>{2, 16, 256}));
}

TEST(GptModel, TheHeadIsTheTokenEmbedding) {
  Gpt gpt(50, 8, 16, 1, 2, 0.0);
  int64_t embedding_sized = 0;
  for (const auto& p : gpt->named_parameters()) {
    embedding_sized += p.value().sizes() == torch::IntArrayRef{50, 16} ? 1 : 0;
  }
  EXPECT_EQ(embedding_sized, 1); // wte.weight, and no head of its own
  auto logits = gpt->forward(torch::zeros({1, 3}, torch::kLong));
  logits.sum().backward();
  EXPECT_GT(gpt->wte->weight.grad().index({torch::indexing::Slice(1)}).abs().sum().item<double>(), 0)
      << "only token 0 was an input: the other rows' gradient comes from the head";
}

TEST(GptModel, ASequenceLongerThanTheContextIsRefused) {
  Gpt gpt(64, 8, 16, 1, 2, 0.0);
  try {
    gpt->forward(torch::zeros({1, 9}, torch::kLong));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("length at most its context 8; got a tensor of shape [1, 9]"),
              std::string::npos) << e.what();
  }
}

// Evaluation's batches hold attention scores of one size whatever the
// context: 500 images or sequences of up to 128 tokens, fewer of longer
// ones (one of 4096), so that a long --context does not run out of memory.
TEST(TextData, EvaluationTakesFewerSequencesOfALongerContext) {
  EXPECT_EQ(examples::evaluation_rows(0), 500); // images
  EXPECT_EQ(examples::evaluation_rows(128), 500);
  EXPECT_EQ(examples::evaluation_rows(256), 125);
  EXPECT_EQ(examples::evaluation_rows(4096), 1);
  for (int64_t length = 129; length <= 4096; length *= 2) {
    EXPECT_LE(examples::evaluation_rows(length) * length * length, 500 * 128 * 128) << length;
  }
}

TEST(TextData, EveryTenthSequenceIsHeldOutAndLabelsAreTheNextBytes) {
  std::string text;
  for (int i = 0; i < 25 * 5 + 3; ++i) {
    text += static_cast<char>('a' + i % 26);
  }
  auto [train, test] = examples::text_splits(text, 4, "the text"); // 25 sequences of 5 bytes, 3 left over
  EXPECT_EQ(train.inputs.sizes(), (std::vector<int64_t>{23, 4}));
  EXPECT_EQ(test.inputs.sizes(), (std::vector<int64_t>{2, 4}));  // sequences 9 and 19
  EXPECT_EQ(test.inputs[0][0].item<int64_t>(), 'a' + (9 * 5) % 26);
  EXPECT_EQ(test.inputs[1][0].item<int64_t>(), 'a' + (19 * 5) % 26);
  EXPECT_EQ(train.inputs[9][0].item<int64_t>(), 'a' + (10 * 5) % 26); // the sequence after the held-out one
  EXPECT_TRUE(train.labels.narrow(1, 0, 3).equal(train.inputs.narrow(1, 1, 3)));
  EXPECT_EQ(train.labels[0][3].item<int64_t>(), 'e');
  EXPECT_EQ(train.inputs.dtype(), torch::kLong);
}

TEST(TextData, ATextTooShortForTenSequencesIsRefused) {
  try {
    examples::text_splits(std::string(49, 'x'), 4, "--text short.txt");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--text short.txt has 49 bytes: fewer than 10 sequences of --context 4 + 1 "
                                         "bytes"), std::string::npos) << e.what();
  }
}

// --text /dev/zero read until memory ran out.
TEST(TextData, ADeviceIsRefusedAsText) {
  try {
    examples::read_text({"/dev/zero"});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--text /dev/zero is not a file (a device, or gone)"), std::string::npos)
        << e.what();
  }
}

// Weights of a GPT of another --context failed on 'wpe''s shape without
// naming the flag; --init-from of model.pt said its header was too long.
TEST(GptModel, WeightsOfAnotherContextNameTheFlag) {
  examples::TrainerNet written("gpt", false, 0.1, 32), here("gpt", false, 0.1, 64);
  const std::string path = testing::scratch("context32.safetensors");
  lockstep::save_safetensors(written, path);
  const std::string said = testing::error_of([&] { examples::init_from(here, path); });
  EXPECT_NE(said.find("--init-from " + path + ": 'wpe', the GPT's position table, has a row per token of --context: "
                      "these weights were written with --context 32, and this run has --context 64. Give --context 32"),
            std::string::npos) << said;

  std::vector<torch::Tensor> loaded;
  for (const auto& item : written->named_parameters()) {
    loaded.push_back(item.value());
  }
  torch::optim::SGD optimizer(here->parameters(), 0.1);
  const std::string resumed = testing::error_of(
      [&] { examples::check_loaded_shapes("ck.ckpt", loaded, examples::expected_tensors(*here), optimizer); });
  EXPECT_NE(resumed.find("checkpoint ck.ckpt does not match this model: 'wpe', the GPT's position table"),
            std::string::npos) << resumed;
  EXPECT_NE(resumed.find("Give --context 32 to go on from them. Or point --checkpoint elsewhere"), std::string::npos)
      << resumed;
}

TEST(GptModel, InitFromATorchSaveArchiveNamesTheSafetensorsBesideIt) {
  examples::TrainerNet net("gpt", false, 0.1, 32);
  const std::string pt = testing::scratch("beside.pt");
  std::remove(testing::scratch("beside.safetensors").c_str()); // a repeat's
  torch::save(net, pt);
  const std::string alone = testing::error_of([&] { examples::init_from(net, pt); });
  EXPECT_NE(alone.find("It begins as a zip archive, which is what torch.save and torch::save write"), std::string::npos)
      << alone;
  lockstep::save_safetensors(net, testing::scratch("beside.safetensors"));
  const std::string beside = testing::error_of([&] { examples::init_from(net, pt); });
  EXPECT_NE(beside.find("--init-from reads safetensors, and " + pt + " is torch::save's archive; give " +
                        testing::scratch("beside.safetensors")),
            std::string::npos) << beside;
}

} // namespace
} // namespace lockstep
