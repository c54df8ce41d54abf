// The words a planned collective carries (Note [Planned collectives] in
// src/comm/planned_collective.cpp): written one-hot per rank, summed as an
// allreduce would, and read back, with no process group.

#include "comm/planned_collective.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace lockstep {
namespace planned_words_test {

// The sum an allreduce would leave: every rank's room added up.
torch::Tensor summed(const std::vector<detail::PlanWords>& words, torch::ScalarType dtype) {
  const int size = static_cast<int>(words.size());
  auto sum = torch::zeros({detail::plan_words_elements(size)}, dtype);
  for (int r = 0; r < size; ++r) {
    auto room = torch::full({detail::plan_words_elements(size)}, 7.0, dtype); // stale: overwritten
    detail::write_plan_words(room, r, size, words[r]);
    sum.add_(room);
  }
  return sum;
}

TEST(PlanWords, EqualWordsReadBackInEveryDtypeAndWorldSize) {
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    for (int size : {2, 3, 7}) {
      // Digits at their largest (255) in every place.
      const detail::PlanWords words{65535, 65535, 4294967295LL};
      EXPECT_EQ(detail::plan_words_disagreement(summed(std::vector<detail::PlanWords>(size, words), dtype), size), "")
          << dtype << " at " << size << " ranks";
    }
  }
}

TEST(PlanWords, AnotherItemOrNumberOnOneRankNamesRankZeroAndThatRank) {
  const detail::PlanWords ours{3, 1, 12};
  std::vector<detail::PlanWords> words(3, ours);
  words[2].item = 0;
  std::string error = detail::plan_words_disagreement(summed(words, torch::kBFloat16), 3);
  EXPECT_NE(error.find("rank 0 sent item 1 of plan 3"), std::string::npos) << error;
  EXPECT_NE(error.find("as its collective #12 but rank 2 sent item 0 of plan 3"), std::string::npos) << error;
  EXPECT_NE(error.find("its result is not used"), std::string::npos) << error;

  // Three ranks whose items sum alike (1 + 2 + 3 = 3 * 2) still differ.
  words = {ours, ours, ours};
  words[0].item = 1, words[1].item = 2, words[2].item = 3;
  error = detail::plan_words_disagreement(summed(words, torch::kFloat), 3);
  EXPECT_NE(error.find("rank 0 sent item 1 of plan 3"), std::string::npos) << error;
  EXPECT_NE(error.find("but rank 1 sent item 2"), std::string::npos) << error;

  words = {ours, ours};
  words[1].seq = 13 + 256 * 256; // differs in a high digit too
  error = detail::plan_words_disagreement(summed(words, torch::kHalf), 2);
  EXPECT_NE(error.find("as its collective #" + std::to_string(13 + 256 * 256)), std::string::npos) << error;
}

TEST(PlanWords, RoomWithoutWordsIsNamedAsSuch) {
  auto room = torch::zeros({detail::plan_words_elements(2)});
  detail::write_plan_words(room, 0, 2, {1, 0, 5});
  room.narrow(0, room.numel() / 2, room.numel() / 2).fill_(0.5); // rank 1's slot: gradients, not digits
  const std::string error = detail::plan_words_disagreement(room, 2);
  EXPECT_NE(error.find("rank 1 sent it without the words of a planned collective"), std::string::npos) << error;
}

TEST(PlanWords, ALargeGroupHasNoRoomAndItsCollectivesAreChecked) {
  EXPECT_GT(detail::plan_words_elements(2), 0);
  EXPECT_EQ(detail::plan_words_elements(2) * 128, detail::plan_words_elements(256));
  EXPECT_EQ(detail::plan_words_elements(257), 0);
}

} // namespace planned_words_test
} // namespace lockstep
