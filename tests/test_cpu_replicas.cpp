// The pure logic around DataParallel's CPU replicas, without threads: the
// memory cache's bookkeeping (Note [CPU replicas' memory] in
// src/util/cpu_cache.cpp) and how the gradient sums are shared out.

#include "../src/util/cpu_cache.h"
#include "../src/dp/parallel_backward.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace lockstep {
namespace detail {
namespace {

constexpr size_t kKiB = 1024;

// Distinct fake addresses: the cache only keeps them.
void* block(uintptr_t i) {
  return reinterpret_cast<void*>(i * 4096);
}

TEST(BlockCache, SmallRequestsAreNotCachedAndLargeOnesRoundUpToAGranule) {
  EXPECT_EQ(BlockCache::size_class(0), 0u);
  EXPECT_EQ(BlockCache::size_class(BlockCache::kMinBytes - 1), 0u);
  EXPECT_EQ(BlockCache::size_class(BlockCache::kMinBytes), BlockCache::kMinBytes);
  EXPECT_EQ(BlockCache::size_class(BlockCache::kMinBytes + 1), BlockCache::kMinBytes + BlockCache::kGranule);
  EXPECT_EQ(BlockCache::size_class(4096 * kKiB), 4096 * kKiB);
}

TEST(BlockCache, AFreedBlockServesTheNextRequestOfItsClassOnly) {
  BlockCache cache;
  const size_t a = 256 * kKiB, b = 512 * kKiB;
  EXPECT_EQ(cache.take(a), nullptr) << "nothing idle yet";
  cache.add_fresh(a);
  cache.add_fresh(b);
  EXPECT_EQ(cache.live_bytes(), a + b);
  EXPECT_TRUE(cache.give(block(1), a).empty());
  EXPECT_EQ(cache.idle_bytes(), a);
  EXPECT_EQ(cache.take(b), nullptr) << "another class";
  EXPECT_EQ(cache.take(a), block(1));
  EXPECT_EQ(cache.take(a), nullptr) << "taken once";
  EXPECT_EQ(cache.idle_bytes(), 0u);
  EXPECT_EQ(cache.live_bytes(), a + b);
  EXPECT_EQ(cache.peak_live_bytes(), a + b);
}

TEST(BlockCache, IdleBytesStayWithinTwiceThePeakAndTheLargestOtherClassGoesFirst) {
  BlockCache cache;
  const size_t small = 64 * kKiB, large = 1024 * kKiB;
  cache.add_fresh(large); // peak: 1 MiB, so at most 2 MiB idle
  EXPECT_TRUE(cache.give(block(1), large).empty());
  cache.add_fresh(small);
  EXPECT_TRUE(cache.give(block(2), small).empty());
  // Shapes changed: 1 MiB of another class, live then freed, goes past the limit.
  cache.add_fresh(large + BlockCache::kGranule);
  auto evicted = cache.give(block(3), large + BlockCache::kGranule);
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_EQ(evicted[0], block(1)) << "the largest idle block of another class";
  EXPECT_LE(cache.idle_bytes(), 2 * cache.peak_live_bytes());
  EXPECT_EQ(cache.take(large + BlockCache::kGranule), block(3)) << "the block just freed stays";
}

TEST(BlockCache, ReleaseForgetsALiveBlockAndDrainReturnsEveryIdleOne) {
  BlockCache cache;
  const size_t a = 128 * kKiB;
  cache.add_fresh(a);
  cache.add_fresh(a);
  cache.add_fresh(2 * a);
  cache.release(a); // went back to the system while the cache was closed
  EXPECT_EQ(cache.live_bytes(), 3 * a);
  cache.give(block(1), a);
  cache.give(block(2), 2 * a);
  auto all = cache.drain();
  EXPECT_EQ(all.size(), 2u);
  EXPECT_EQ(cache.idle_bytes(), 0u);
  EXPECT_EQ(cache.take(a), nullptr);
}

// The MLP of the benchmarks: the two large weights must go to different
// workers, not both to the first as a round robin over parameters gave.
TEST(AssignSums, LargestParametersFirstEachToTheLeastLoadedWorker) {
  const std::vector<int64_t> mlp = {1024 * 784, 1024, 1024 * 1024, 1024, 10 * 1024, 10};
  const auto owner = assign_sums(mlp, 2);
  ASSERT_EQ(owner.size(), mlp.size());
  EXPECT_NE(owner[0], owner[2]);
  std::vector<int64_t> load(2, 0);
  for (size_t p = 0; p < mlp.size(); ++p) {
    load[owner[p]] += mlp[p];
  }
  EXPECT_LE(std::max(load[0], load[1]), 1024 * 1024) << "no worker sums more than the largest layer";

  EXPECT_EQ(assign_sums({5, 5, 5}, 1), (std::vector<size_t>{0, 0, 0}));
  EXPECT_EQ(assign_sums({7, 3}, 4), (std::vector<size_t>{0, 1})) << "more workers than parameters";
  EXPECT_TRUE(assign_sums({}, 2).empty());
}

} // namespace
} // namespace detail
} // namespace lockstep
