// Note [A flat shard as boxes] (src/io/boxes.h): a range of a tensor's
// elements as boxes, each contiguous in the range, and box intersections;
// and the optimizer state's names beside them (Note [Optimizer state in the
// DCP layout]).

#include "../src/fsdp/dcp_optimizer.h"
#include "../src/io/boxes.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

// The elements of `shape` (numbered in row-major order) that `boxes` cover,
// box after box.
torch::Tensor elements_of(const std::vector<int64_t>& shape, const std::vector<detail::Box>& boxes) {
  const auto numbered = torch::arange(c10::multiply_integers(shape), torch::kLong).view(shape);
  std::vector<torch::Tensor> parts{torch::empty({0}, torch::kLong)};
  for (const auto& box : boxes) {
    auto part = numbered;
    for (size_t d = 0; d < shape.size(); ++d) {
      part = part.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
    }
    parts.push_back(part.reshape({-1}));
  }
  return torch::cat(parts);
}

TEST(Boxes, EveryRangeOfEveryShapeIsCoveredInOrderByAtMostTwoNdimMinusOneBoxes) {
  const std::vector<std::vector<int64_t>> shapes{{7}, {4, 5}, {3, 4, 5}, {2, 3, 1, 4}, {6, 1}, {1, 7}};
  for (const auto& shape : shapes) {
    const int64_t numel = c10::multiply_integers(shape);
    for (int64_t begin = 0; begin <= numel; ++begin) {
      for (int64_t end = begin; end <= numel; ++end) {
        const auto boxes = detail::boxes_of_range(shape, begin, end);
        EXPECT_LE(boxes.size(), 2 * shape.size() - 1);
        EXPECT_TRUE(torch::equal(elements_of(shape, boxes), torch::arange(begin, end, torch::kLong)))
            << "shape of " << shape.size() << " dims, range [" << begin << ", " << end << ")";
      }
    }
  }
}

TEST(Boxes, AMidRowRangeSplitsIntoThePartialRowsAndTheWholeRowsBetween) {
  const auto boxes = detail::boxes_of_range({4, 5}, 3, 17);
  ASSERT_EQ(boxes.size(), 3u);
  EXPECT_EQ(boxes[0].offsets, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(boxes[0].sizes, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(boxes[1].offsets, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(boxes[1].sizes, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(boxes[2].offsets, (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(boxes[2].sizes, (std::vector<int64_t>{1, 2}));
}

TEST(Boxes, AScalarIsOneBoxOfNoDimensions) {
  EXPECT_EQ(detail::boxes_of_range({}, 0, 1).size(), 1u);
  EXPECT_TRUE(detail::boxes_of_range({}, 0, 0).empty());
  EXPECT_TRUE(detail::boxes_of_range({3, 0}, 0, 0).empty());
}

TEST(Boxes, IntersectionIsTheCommonBoxOrNone) {
  detail::Box common;
  ASSERT_TRUE(detail::intersect({{0, 2}, {4, 3}}, {{2, 0}, {3, 4}}, common));
  EXPECT_EQ(common.offsets, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(common.sizes, (std::vector<int64_t>{2, 2}));
  EXPECT_FALSE(detail::intersect({{0, 0}, {2, 2}}, {{2, 0}, {1, 2}}, common));
}

// PyTorch's names for a parameter's optimizer state, and which names a
// model-only load leaves alone: state.<parameter>.<key> of the model's own
// parameters, the key without a dot (a deeper name is another parameter's).
TEST(DcpOptimizerNames, StateNamesArePyTorchsAndOnlyTheModelsParametersOnes) {
  EXPECT_EQ(detail::optimizer_state_name("0.weight", "exp_avg"), "state.0.weight.exp_avg");
  const std::vector<std::string> parameters{"0.weight", "fc.bias", "state"};
  EXPECT_TRUE(detail::is_optimizer_state_name("state.0.weight.exp_avg", parameters));
  EXPECT_TRUE(detail::is_optimizer_state_name("state.fc.bias.step", parameters));
  EXPECT_TRUE(detail::is_optimizer_state_name("state.state.step", parameters)); // a parameter named "state"
  EXPECT_FALSE(detail::is_optimizer_state_name("state.fc.weight.exp_avg", parameters)); // not the model's
  EXPECT_FALSE(detail::is_optimizer_state_name("state.0.weight", parameters));          // no key
  EXPECT_FALSE(detail::is_optimizer_state_name("state.", parameters));
  EXPECT_FALSE(detail::is_optimizer_state_name("optim.state.0.weight.exp_avg", parameters));
  EXPECT_FALSE(detail::is_optimizer_state_name("0.weight", parameters));
}

} // namespace
} // namespace lockstep
