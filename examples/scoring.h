#pragma once

// How lockstep-train scores a model: its loss and accuracy over images'
// classes, or over a text's next tokens (--model gpt), summed in a Tally,
// and the words and metrics.jsonl keys that report them.

#include "checkpoint.h"
#include "options.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

namespace lockstep {
namespace examples {

inline std::string percent(const Tally& t) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * t.correct / std::max<int64_t>(1, t.rows));
  return text;
}

inline double mean_loss(const Tally& t) {
  return t.loss_sum / std::max<int64_t>(1, t.rows);
}

inline double accuracy(const Tally& t) {
  return static_cast<double>(t.correct) / std::max<int64_t>(1, t.rows);
}

// The test loss's words: with its perplexity under --model gpt, whose loss
// is per token.
inline std::string test_loss_words(const Config& config, const Tally& tested) {
  char text[96];
  std::snprintf(text, sizeof(text), config.model == "gpt" ? "test loss %.4f (perplexity %.2f)" : "test loss %.4f",
                mean_loss(tested), std::exp(mean_loss(tested)));
  return text;
}

// What a tally's rows are: images, or predicted tokens under --model gpt.
inline const char* row_unit(const Config& config) {
  return config.model == "gpt" ? "tokens" : "samples";
}

// metrics.jsonl's key of the training speed.
inline std::string per_second(const Config& config) {
  return std::string(row_unit(config)) + "_per_second";
}

// --model gpt: the record's test perplexity, e^(mean loss per token).
inline void add_perplexity(const Config& config, const Tally& tested, nlohmann::json& record) {
  if (config.model == "gpt") {
    record["test_perplexity"] = std::exp(mean_loss(tested));
  }
}

// The mean loss of `logits` against `labels`, and this rank's tally: one
// prediction per image's class, or per position of a token sequence.
inline std::pair<torch::Tensor, Tally> score(const torch::Tensor& logits, const torch::Tensor& labels,
                                             at::Reduction::Reduction reduction) {
  auto loss = torch::cross_entropy_loss(logits.flatten(0, -2), labels.flatten(), {}, reduction);
  const int64_t rows = labels.numel();
  const double sum = loss.item<double>() * (reduction == at::Reduction::Sum ? 1 : rows);
  return {loss, Tally{sum, logits.argmax(-1).eq(labels).sum().item<int64_t>(), rows}};
}

// Rows of the test set a rank evaluates at once: 500 images, or as many
// sequences of `length` tokens as hold the attention scores of 500 of 128
// (their memory grows with the length squared), at least one: a long
// --context would otherwise run out of memory in evaluation at any
// --batch-size.
inline int64_t evaluation_rows(int64_t length) {
  constexpr int64_t kRows = 500, kLength = 128;
  if (length <= kLength) {
    return kRows;
  }
  return std::max<int64_t>(1, kRows * kLength * kLength / (length * length));
}

} // namespace examples
} // namespace lockstep
