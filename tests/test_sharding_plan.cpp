// FullyShardedDataParallel's pure planning (units and shard layouts, with no
// tensors), and its pool of mapped pages; no threads.

#include <lockstep/detail/sharded_core.h>

#include "../src/util/mapped_memory.h"

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

// Note [Pages for transient buffers]: a step allocates the sizes the step
// before freed, so freed mappings are kept for the next of their length.
TEST(MappedMemory, AFreedBufferServesTheNextOfItsLength) {
  const int64_t numel = (1 << 18) + 12345; // a length no other test allocates
  const void* first = nullptr;
  {
    auto buffer = empty_mapped(numel, torch::kFloat);
    first = buffer.data_ptr();
    buffer.fill_(1.0);
  }
  auto again = empty_mapped(numel, torch::kFloat);
  EXPECT_EQ(again.data_ptr(), first);
  auto longer = empty_mapped(numel + 1, torch::kFloat);
  EXPECT_NE(longer.data_ptr(), first);
}

} // namespace
} // namespace detail
} // namespace lockstep
