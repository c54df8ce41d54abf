// DistributedDataParallel's bucket assignment: which parameters share a
// bucket, in which order, and the default bucket sizes.

#include "../src/ddp/reducer.h"
#include <lockstep/distributed_data_parallel.h>

#include "support/errors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace lockstep {
namespace {

using testing::error_of;

TEST(BucketAssignment, ReverseOrderFirstBucketSmall) {
  const std::vector<std::string> keys(6, "float");
  // 4 bytes each; first cap 8 bytes, later caps 12 bytes.
  auto buckets = detail::compute_bucket_assignment({4, 4, 4, 4, 4, 4}, keys, 8, 12);
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{5, 4}, {3, 2, 1}, {0}}));
}

TEST(BucketAssignment, LargeParameterGetsItsOwnBucketAndEmptyOnesFit) {
  const std::vector<std::string> keys(4, "float");
  auto buckets = detail::compute_bucket_assignment({0, 100, 0, 3}, keys, 8, 12);
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{3, 2, 1}, {0}}));
}

TEST(BucketAssignment, DtypesNeverShareABucket) {
  auto buckets = detail::compute_bucket_assignment({4, 4, 4, 4}, {"float", "double", "float", "double"}, 100, 100);
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{3, 1}, {2, 0}}));
}

TEST(BucketAssignment, FollowsAGivenOrder) {
  const std::vector<std::string> keys(6, "float");
  // The order gradients became ready in: the same caps as above.
  auto buckets = detail::compute_bucket_assignment({4, 4, 4, 4, 4, 4}, keys, 8, 12, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{0, 1}, {2, 3, 4}, {5}}));
  EXPECT_ERROR_SAYS(detail::compute_bucket_assignment({4, 4}, {"f", "f"}, 8, 12, {1, 1}), "not a permutation");
}

TEST(BucketAssignment, EveryParameterExactlyOnce) {
  std::vector<int64_t> bytes;
  for (int i = 0; i < 37; ++i) {
    bytes.push_back((i * 7919) % 1000);
  }
  auto buckets = detail::compute_bucket_assignment(bytes, std::vector<std::string>(37, "k"), 1000, 3000);
  std::vector<int> seen(37, 0);
  for (const auto& b : buckets) {
    for (size_t i : b) {
      ++seen[i];
    }
  }
  EXPECT_EQ(seen, std::vector<int>(37, 1));
}

TEST(BucketAssignment, DefaultsAreOneAndTwentyFiveMiB) {
  EXPECT_EQ(kFirstBucketBytes, 1 << 20);
  EXPECT_EQ(DistributedOptions().bucket_bytes(), 25 << 20);
}

// An infinite cap once became INT64_MIN bytes, then one-byte buckets: one
// collective per parameter, the opposite of what was asked.
TEST(BucketAssignment, ABucketCapThatIsNotAFiniteNumberOfMiBIsRefused) {
  for (double mib : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan(""), 1e13}) {
    EXPECT_ERROR_SAYS(DistributedOptions().bucket_cap_mb(mib), "bucket_cap_mb must be a finite number of MiB above 0");
  }
  EXPECT_EQ(DistributedOptions().bucket_cap_mb(1e-9).bucket_bytes(), 1);
  EXPECT_EQ(DistributedOptions().bucket_cap_mb(8e12).bucket_bytes(), static_cast<int64_t>(8e12 * 1024 * 1024));
}

} // namespace
} // namespace lockstep
