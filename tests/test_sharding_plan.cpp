// FullyShardedDataParallel's pure planning: units and shard layouts, with no
// tensors and no threads.

#include <lockstep/detail/sharded_core.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace lockstep {
namespace detail {
namespace {

TEST(ShardingPlan, ParametersGoToTheLongestUnitPathAndTheRootKeepsTheRest) {
  const std::vector<std::string> names{"scale", "encoder.weight", "encoder.block.bias", "layers.3.weight",
                                       "layers.31.weight", "layers.3x.bias", "decoder.weight"};
  const std::vector<std::string> paths{"encoder", "layers.3", "encoder.block"};
  const std::vector<size_t> expected{0, 1, 3, 2, 0, 0, 0};
  EXPECT_EQ(assign_units(names, paths), expected);
}

TEST(ShardingPlan, NoUnitsLeavesEverythingToTheRoot) {
  EXPECT_EQ(assign_units({"a.weight", "b"}, {}), (std::vector<size_t>{0, 0}));
}

TEST(ShardingPlan, ShardsArePaddedToAMultipleOfTheWorldSize) {
  const auto even = shard_layout(104, 2);
  EXPECT_EQ(even.shard, 52);
  EXPECT_EQ(even.padded, 104);
  const auto odd = shard_layout(104, 3);
  EXPECT_EQ(odd.shard, 35);
  EXPECT_EQ(odd.padded, 105);
  EXPECT_EQ(odd.numel, 104);
  const auto tiny = shard_layout(1, 4);
  EXPECT_EQ(tiny.shard, 1);
  EXPECT_EQ(tiny.padded, 4);
  EXPECT_EQ(shard_layout(0, 3).shard, 0);
}

} // namespace
} // namespace detail
} // namespace lockstep
