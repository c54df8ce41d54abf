// PowerSGD's numerics on a group of one, without threads: the plan of a
// bucket, the orthonormalisation, exactness at the matrix's rank, error
// feedback, the start iteration, and the state's round trip. Ported in
// spirit from PyTorch's test_powerSGD_ddp_comm_hook_nccl and its hook
// tests; the ranks' agreement is in test_powersgd_threads.cpp.

#include <lockstep/lockstep.h>

#include "../src/ddp/powersgd_kernels.h"
#include "../src/ddp/powersgd_plan.h"
#include "support/errors.h"
#include "support/powersgd_checks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace lockstep {
namespace {

using testing::bucket_of;
using testing::error_of;
using testing::saved;

// M = A B^T with A (rows x rank) and B (cols x rank) drawn from `seed`: a
// matrix of that rank.
torch::Tensor of_rank(int64_t rows, int64_t cols, int64_t rank, uint64_t seed = 0) {
  auto generator = at::detail::createCPUGenerator(seed);
  auto a = torch::randn({rows, rank}, generator, torch::kFloat);
  auto b = torch::randn({cols, rank}, generator, torch::kFloat);
  return torch::matmul(a, b.t());
}

TEST(PowerSGD, PlanCompressesTheMatricesWorthItAndSendsTheRestWhole) {
  auto bucket = bucket_of({torch::zeros({64, 32}), torch::zeros({64}), torch::zeros({3, 2}), torch::zeros({8, 3, 3, 3}),
                           torch::zeros({40, 5, 2})},
                          1);
  auto plan = detail::plan_powersgd(bucket, 4, 2.0);
  // 64 x 32: (64 + 32) * 4 * 2 = 768 < 2048. 8 x 27: (8 + 27) * 4 * 2 = 280 > 216. 40 x 10: 400 = 400, not less.
  ASSERT_EQ(plan.matrices.size(), 1u);
  EXPECT_EQ(plan.matrices[0].gradient, 0u);
  EXPECT_EQ(plan.matrices[0].rows, 64);
  EXPECT_EQ(plan.matrices[0].cols, 32);
  EXPECT_EQ(plan.p_elements, 64 * 4);
  EXPECT_EQ(plan.q_elements, 32 * 4);
  // Everything after the matrix, trailing flag included, is one range.
  ASSERT_EQ(plan.whole.size(), 1u);
  EXPECT_EQ(plan.whole[0].first, 2048);
  EXPECT_EQ(plan.whole[0].second, 64 + 6 + 216 + 400 + 1);
  EXPECT_EQ(plan.parameter_elements, bucket.buffer.numel() - 1);
  EXPECT_NEAR(plan.rate(), 2735.0 / (687 + 256 + 128), 1e-9);
  // At rank 2 the conv weight is worth it as well; the rank never exceeds a side.
  auto wider = detail::plan_powersgd(bucket, 2, 2.0);
  ASSERT_EQ(wider.matrices.size(), 3u);
  EXPECT_EQ(wider.matrices[1].gradient, 3u);
  EXPECT_EQ(wider.matrices[1].q_offset, 32 * 2);
  EXPECT_EQ(wider.whole.size(), 2u); // the vector and 3 x 2 merged, then the flag
  auto thin = detail::plan_powersgd(bucket_of({torch::zeros({2, 50})}), 8, 0.5);
  ASSERT_EQ(thin.matrices.size(), 1u);
  EXPECT_EQ(thin.matrices[0].rank, 2);
  EXPECT_FALSE(plan.gaps);
  auto gapped = bucket_of({torch::zeros({4, 4}), torch::zeros({3})});
  gapped.gradients[1] = gapped.buffer.narrow(0, 17, 2); // one element between the two
  EXPECT_TRUE(detail::plan_powersgd(gapped, 1, 2.0).gaps);
}

TEST(PowerSGD, GradientsThatDoNotViewTheBufferAreRefused) {
  auto bucket = bucket_of({torch::zeros({4, 4})});
  bucket.gradients[0] = torch::zeros({4, 4});
  EXPECT_NE(error_of([&] { detail::plan_powersgd(bucket, 1, 2.0); }).find("gradient 0 of bucket 0 is not a view of "
                                                                            "numel elements of the bucket's buffer"),
            std::string::npos);
  // A transposed view's memory is not its rows: compressing it would
  // approximate another matrix.
  bucket.gradients[0] = bucket.buffer.narrow(0, 0, 16).view({4, 4}).t();
  EXPECT_NE(error_of([&] { detail::plan_powersgd(bucket, 1, 2.0); }).find("its rows in order (strides [1, 4])"),
            std::string::npos);
}

// DDP's slot for a channels-last weight takes its strides; its memory holds
// its rows (output channels) in order, and it is compressed as such.
TEST(PowerSGD, AChannelsLastGradientIsPlannedAsTheRowsItsMemoryHolds) {
  auto bucket = bucket_of({torch::zeros({16, 8, 3, 3})});
  bucket.gradients[0] = bucket.buffer.narrow(0, 0, 16 * 8 * 9).view({16, 3, 3, 8}).permute({0, 3, 1, 2});
  ASSERT_TRUE(bucket.gradients[0].is_contiguous(torch::MemoryFormat::ChannelsLast));
  const auto plan = detail::plan_powersgd(bucket, 2, 1.0);
  ASSERT_EQ(plan.matrices.size(), 1u);
  EXPECT_EQ(plan.matrices[0].rows, 16);
  EXPECT_EQ(plan.matrices[0].cols, 72);
  EXPECT_EQ(plan.offsets[0], 0);
}

TEST(PowerSGD, OrthogonalizeGivesOrthonormalColumnsAndKeepsAZeroColumnZero) {
  for (int64_t rank : {3, 2}) { // rank 2: the third column is what rounding leaves
    auto m = of_rank(20, 3, rank);
    detail::orthogonalize_(m);
    EXPECT_TRUE(torch::allclose(torch::matmul(m.t(), m), torch::eye(3), 1e-5, 1e-5)) << torch::matmul(m.t(), m);
  }
  // In every dtype a bucket may have: float16 rounds float32's smallest
  // normal to 0, and 0 / 0 is NaN.
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    auto zero = torch::zeros({6, 2}, dtype);
    zero.narrow(1, 1, 1).fill_(2);
    detail::orthogonalize_(zero);
    EXPECT_FALSE(zero.isnan().any().item<bool>()) << dtype;
    EXPECT_EQ(zero.narrow(1, 0, 1).abs().sum().item<float>(), 0.0f) << dtype;
    EXPECT_NEAR(zero.narrow(1, 1, 1).norm().item<float>(), 1.0f, 1e-2) << dtype;
  }
}

// The end of a round reads its factors once: each matrix's bound on its
// elements, a Q's zero column (a layer with no gradient, whose Q warm start
// must not keep), and a factor that is not finite.
TEST(PowerSGD, FactorSummaryGivesEachMatrixsBoundAndZeroColumnsAndCatchesNonFinite) {
  auto bucket = bucket_of({torch::zeros({64, 32}), torch::zeros({8, 3, 3, 3})});
  auto plan = detail::plan_powersgd(bucket, 2, 2.0);
  ASSERT_EQ(plan.matrices.size(), 2u);
  auto ps = torch::full({plan.p_elements}, 0.5);
  auto qs = torch::ones({plan.q_elements});
  ps[plan.matrices[1].p_offset + 3] = -3.0;  // row 1, column 1 of the second matrix's P
  qs[plan.matrices[1].q_offset + 2 * 5] = 0; // its Q's first column: zero but one element
  auto summary = detail::summarize_factors(plan, ps, qs);
  EXPECT_TRUE(summary.finite);
  ASSERT_EQ(summary.bound.size(), 2u);
  EXPECT_EQ(summary.bound[0], 2 * 2 * 0.5 * 1.0);
  EXPECT_EQ(summary.bound[1], 2 * 2 * 3.0 * 1.0);
  EXPECT_EQ(summary.q_has_zero_column, (std::vector<bool>{false, false}));
  qs.narrow(0, plan.matrices[1].q_offset, plan.matrices[1].cols * 2).view({-1, 2}).narrow(1, 0, 1).zero_();
  EXPECT_EQ(detail::summarize_factors(plan, ps, qs).q_has_zero_column, (std::vector<bool>{false, true}));
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    auto p = ps.clone();
    p[7] = bad;
    EXPECT_FALSE(detail::summarize_factors(plan, p, qs).finite) << bad;
    auto q = qs.clone();
    q[plan.q_elements - 1] = bad;
    EXPECT_FALSE(detail::summarize_factors(plan, ps, q).finite) << bad;
  }
}

// A contiguous matrix in memory takes a loop over its rows; any other (a
// column-major view here, a GPU's in a job) the tensor operations. Both
// give the same columns where the matrix has them; beyond its rank, what
// rounding leaves differs, but orthonormal either way.
TEST(PowerSGD, OrthogonalizeGivesTheSameColumnsThroughRowsAsThroughTensorOperations) {
  for (int64_t rank : {4, 2}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      auto rows = of_rank(30, 4, rank).to(dtype);
      auto strided = rows.t().contiguous().t(); // the same values, column-major
      ASSERT_FALSE(strided.is_contiguous());
      detail::orthogonalize_(rows);
      detail::orthogonalize_(strided);
      EXPECT_TRUE(torch::allclose(rows.narrow(1, 0, rank), strided.narrow(1, 0, rank), 1e-5, 1e-5))
          << "rank " << rank << " " << dtype << "\n" << rows << "\n" << strided;
      for (const auto& m : {rows, strided}) {
        EXPECT_TRUE(torch::allclose(torch::matmul(m.t(), m), torch::eye(4, dtype), 1e-5, 1e-5)) << m;
      }
    }
  }
}

// M = P Q^T by rows (Note [Writing P Q^T by rows]) where M is contiguous in
// memory, by torch::matmul_out otherwise: the same M either way, and the
// residual given loses it. Rank 5 takes the rows' loop for any rank; 37
// columns leave a tail after the rows' vectors.
TEST(PowerSGD, LowRankProductByRowsIsPTimesQTransposed) {
  for (int64_t rank : {1, 3, 4, 5, 8}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      auto p = torch::randn({33, rank}).to(dtype);
      auto q = torch::randn({37, rank}).to(dtype);
      auto rows = torch::full({33, 37}, 7.0, dtype); // overwritten, not added to
      detail::low_rank_product_(rows, p, q);
      auto strided = torch::full({37, 33}, 7.0, dtype).t();
      detail::low_rank_product_(strided, p, q);
      const auto expected = torch::matmul(p.to(torch::kDouble), q.to(torch::kDouble).t()).to(dtype);
      EXPECT_TRUE(torch::allclose(rows, expected, 1e-5, 1e-5)) << "rank " << rank << " " << dtype;
      EXPECT_TRUE(torch::allclose(strided, expected, 1e-5, 1e-5)) << "rank " << rank << " " << dtype;
      const auto kept = torch::randn({33, 37}).to(dtype);
      auto residual = kept.clone();
      auto with_residual = torch::empty({33, 37}, dtype);
      detail::low_rank_product_(with_residual, p, q, residual);
      EXPECT_TRUE(torch::equal(with_residual, rows)) << "rank " << rank << " " << dtype;
      EXPECT_TRUE(torch::equal(residual, kept - rows)) << "rank " << rank << " " << dtype;
      auto strided_residual = kept.t().contiguous().t();
      detail::low_rank_product_(strided, p, q, strided_residual);
      EXPECT_TRUE(torch::allclose(strided_residual, kept - expected, 1e-5, 1e-5)) << "rank " << rank << " " << dtype;
    }
  }
}

// Every element of M = P Q^T is ((p0 q0 + p1 q1) + p2 q2) + ..., each
// product and sum rounded on its own, whatever the CPU: every rank writes
// the same M from the same averaged factors, and so keeps the same
// parameters, on AVX512, AVX2 or neither (Note [PowerSGD's passes over M]).
TEST(PowerSGD, LowRankProductRoundsEachProductAndSumInOrder) {
  const int64_t rows = 5, cols = 70, rank = 4;
  auto p = torch::randn({rows, rank});
  auto q = torch::randn({cols, rank});
  auto m = torch::empty({rows, cols});
  detail::low_rank_product_(m, p, q);
  const auto* pp = p.data_ptr<float>();
  const auto* qq = q.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      volatile float sum = pp[i * rank] * qq[j * rank]; // volatile: no fused multiply-add here either
      for (int64_t k = 1; k < rank; ++k) {
        volatile float product = pp[i * rank + k] * qq[j * rank + k];
        sum = sum + product;
      }
      ASSERT_EQ(m[i][j].item<float>(), sum) << "(" << i << ", " << j << ")";
    }
  }
}

// P = (gradient + error) Q and Q = M^T P by rows, where every operand is a
// contiguous float matrix at a rank the rows' loops are made for, and by
// tensor operations otherwise (double, a column-major gradient, rank 5):
// the same factors either way, and the same kept sum.
TEST(PowerSGD, ProjectionsByRowsMatchTensorOperations) {
  for (int64_t rank : {1, 2, 3, 4, 5, 8}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      for (bool column_major : {false, true}) {
        const int64_t n = 19, m = 53;
        auto gradient = torch::randn({n, m}).to(dtype);
        if (column_major) {
          gradient = gradient.t().contiguous().t();
        }
        const auto error = torch::randn({n, m}).to(dtype);
        const auto q = torch::randn({m, rank}).to(dtype);
        const auto sum = (gradient.to(torch::kDouble) + error.to(torch::kDouble));
        const auto where = "rank " + std::to_string(rank) + " " + c10::toString(dtype) +
            (column_major ? " column-major" : "");
        auto kept = torch::full({n, m}, 7.0, dtype);
        auto p = torch::empty({n, rank}, dtype);
        detail::project_(p, gradient, error, q, kept);
        EXPECT_TRUE(torch::equal(kept, gradient + error)) << where;
        EXPECT_TRUE(torch::allclose(p.to(torch::kDouble), torch::matmul(sum, q.to(torch::kDouble)), 1e-4, 1e-4))
            << where;
        auto p_alone = torch::empty({n, rank}, dtype);
        detail::project_(p_alone, gradient, torch::Tensor(), q, torch::Tensor());
        EXPECT_TRUE(torch::allclose(p_alone.to(torch::kDouble),
                                    torch::matmul(gradient.to(torch::kDouble), q.to(torch::kDouble)), 1e-4, 1e-4))
            << where;
        auto q_out = torch::full({m, rank}, 7.0, dtype); // overwritten, not added to
        detail::project_transposed_(q_out, kept, p);
        EXPECT_TRUE(torch::allclose(q_out.to(torch::kDouble),
                                    torch::matmul(kept.to(torch::kDouble).t(), p.to(torch::kDouble)), 1e-4, 1e-4))
            << where;
      }
    }
  }
}

TEST(PowerSGD, RankRMatrixIsExactAtRankRAndNotBelow) {
  ProcessGroup one;
  for (int64_t rank : {3, 5, 2}) {
    auto m = of_rank(48, 24, 3); // worth compressing at each rank: (48 + 24) * 5 * 2 < 48 * 24
    auto bucket = bucket_of({m, torch::ones({24})});
    PowerSGD powersgd(PowerSGDOptions().rank(rank).start_iteration(0).error_feedback(false).warm_start(false));
    powersgd(one, bucket)->wait();
    const double error = (bucket.gradients[0] - m).abs().max().item<double>();
    if (rank >= 3) {
      EXPECT_LT(error, 1e-4) << "rank " << rank;
    } else {
      EXPECT_GT(error, 1e-2) << "rank 2 cannot hold a rank-3 matrix";
    }
    EXPECT_TRUE(torch::equal(bucket.gradients[1], torch::ones({24})));
  }
}

// Buckets of two dtypes (a model with float32 and float64 layers; DDP makes
// a bucket per dtype): their Qs go in one allreduce per dtype, as one
// collective carries one dtype. All of them in one threw at every step.
TEST(PowerSGD, BucketsOfTwoDtypesAreEachExactAtTheirRank) {
  ProcessGroup one;
  PowerSGD powersgd(PowerSGDOptions().rank(3).start_iteration(0).error_feedback(false).warm_start(false));
  const auto m = of_rank(48, 24, 3);
  auto first = bucket_of({m});
  first.last = false;
  auto second = bucket_of({m});
  second.index = 1;
  second.buffer = second.buffer.to(torch::kDouble);
  second.gradients[0] = second.buffer.view({48, 24});
  auto first_work = powersgd(one, first);
  auto second_work = powersgd(one, second);
  first_work->wait();
  second_work->wait();
  EXPECT_LT((first.gradients[0] - m).abs().max().item<double>(), 1e-4);
  EXPECT_LT((second.gradients[0] - m.to(torch::kDouble)).abs().max().item<double>(), 1e-4);
  EXPECT_EQ(second.gradients[0].scalar_type(), torch::kDouble);
}

// The rate is the whole iteration's: a last bucket of biases alone, sent
// whole, does not make it 1.
TEST(PowerSGD, CompressionRateCountsEveryBucketOfTheIteration) {
  ProcessGroup one;
  PowerSGD powersgd(PowerSGDOptions().rank(1).start_iteration(0));
  auto matrix = bucket_of({of_rank(48, 24, 1)});
  matrix.last = false;
  auto biases = bucket_of({torch::ones({10})});
  biases.index = 1;
  biases.parameters = {1};
  powersgd(one, matrix)->wait();
  powersgd(one, biases)->wait();
  EXPECT_DOUBLE_EQ(powersgd.compression_rate(), (48.0 * 24 + 10) / ((48 + 24) * 1 + 10));
}

// A tensor of PowerSGD's saved state ("parameter.0.error", ...).
TEST(PowerSGD, ErrorFeedbackCarriesTheResidualIntoTheNextIteration) {
  ProcessGroup one;
  PowerSGD powersgd(PowerSGDOptions().rank(1).start_iteration(2));
  auto m = of_rank(16, 8, 3);
  auto sent = torch::zeros({16, 8});
  for (int i = 0; i < 2; ++i) { // plain allreduces: the gradient comes back as it was
    auto bucket = bucket_of({m});
    powersgd(one, bucket)->wait();
    EXPECT_TRUE(torch::equal(bucket.gradients[0], m));
  }
  // Then m once and zeros after: what comes out, plus what is still owed,
  // adds up to m (the error telescopes), and what is owed shrinks.
  double owed = 0;
  for (int i = 0; i < 4; ++i) {
    auto bucket = bucket_of({i == 0 ? m : torch::zeros({16, 8}), torch::full({8}, 3.0)}); // the bias goes whole
    powersgd(one, bucket)->wait();
    sent += bucket.gradients[0];
    EXPECT_TRUE(torch::equal(saved(powersgd, "parameter.1.error"), torch::zeros({8}))) << "iteration " << i;
    const auto error = saved(powersgd, "parameter.0.error");
    EXPECT_TRUE(torch::allclose(sent + error.view({16, 8}), m, 1e-4, 1e-5)) << "iteration " << i;
    const double norm = error.norm().item<double>();
    if (i > 0) {
      EXPECT_LT(norm, owed) << "iteration " << i;
    }
    owed = norm;
  }
  EXPECT_EQ(powersgd.iteration(), 6);
}

// Note [PowerSGD's state]: an overflow in one bucket skips the whole step
// (the loss scaler's decision), so the bucket that stayed finite keeps last
// iteration's error and Q too, or the skipped step's gradient would come
// back in the next one.
TEST(PowerSGD, AnOverflowInOneBucketKeepsEveryBucketsState) {
  ProcessGroup one;
  PowerSGD powersgd(PowerSGDOptions().rank(1).start_iteration(0));
  auto step = [&](const torch::Tensor& a, const torch::Tensor& b) {
    auto first = bucket_of({a});
    first.last = false;
    auto second = bucket_of({b});
    second.index = 1;
    second.parameters = {1};
    second.name = "bucket 1";
    auto pending_first = powersgd(one, first); // both started, then both waited, as DDP does
    auto pending_second = powersgd(one, second);
    pending_first->wait();
    pending_second->wait();
  };
  step(of_rank(16, 8, 3, 1), of_rank(16, 8, 3, 2));
  const auto error = saved(powersgd, "parameter.0.error");
  const auto q = saved(powersgd, "parameter.0.q");
  auto overflowed = of_rank(16, 8, 3, 4);
  overflowed[0][0] = std::numeric_limits<float>::infinity();
  step(of_rank(16, 8, 3, 3), overflowed);
  EXPECT_TRUE(torch::equal(saved(powersgd, "parameter.0.error"), error)) << "the finite bucket's error moved";
  EXPECT_TRUE(torch::equal(saved(powersgd, "parameter.0.q"), q)) << "the finite bucket's Q moved";
  step(of_rank(16, 8, 3, 3), of_rank(16, 8, 3, 4));
  EXPECT_FALSE(torch::equal(saved(powersgd, "parameter.0.error"), error)) << "a finite step keeps its state";
  EXPECT_TRUE(torch::isfinite(saved(powersgd, "parameter.1.error")).all().item<bool>());
}

TEST(PowerSGD, TheFirstIterationsArePlainAndOnlyTheLastBucketCounts) {
  ProcessGroup one;
  PowerSGD powersgd(PowerSGDOptions().rank(1).start_iteration(2));
  auto m = of_rank(16, 8, 4);
  for (int i = 0; i < 3; ++i) {
    auto first = bucket_of({m});
    first.last = false;
    powersgd(one, first)->wait();
    auto last = bucket_of({m});
    last.index = 1;
    powersgd(one, last)->wait();
    EXPECT_EQ(powersgd.iteration(), i + 1);
    EXPECT_EQ(torch::equal(first.gradients[0], m), i < 2) << "iteration " << i;
  }
}

TEST(PowerSGD, SavedStateResumesExactly) {
  ProcessGroup one;
  auto options = PowerSGDOptions().rank(2).start_iteration(2).seed(7);
  PowerSGD running(options);
  auto gradient = [](int i) { return of_rank(12, 10, 4, static_cast<uint64_t>(i)); };
  for (int i = 0; i < 5; ++i) {
    auto bucket = bucket_of({gradient(i), torch::ones({3})});
    running(one, bucket)->wait();
  }
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  running.save(out);
  out.save_to(bytes);
  PowerSGD resumed(options);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  resumed.load(in);
  EXPECT_EQ(resumed.iteration(), 5);
  EXPECT_GT(running.compression_rate(), 1.0);
  EXPECT_EQ(resumed.compression_rate(), running.compression_rate()) << "what a resumed run reports before its next step";
  for (int i = 5; i < 8; ++i) {
    auto a = bucket_of({gradient(i), torch::ones({3})});
    auto b = bucket_of({gradient(i), torch::ones({3})});
    running(one, a)->wait();
    resumed(one, b)->wait();
    EXPECT_TRUE(torch::equal(a.buffer, b.buffer)) << "iteration " << i;
  }
  // The same state in a hook of another rank (a resume with another
  // --powersgd-rank) keeps the iteration and the error feedback, and draws
  // the Q's anew at its rank (Note [PowerSGD state of another rank]), with
  // no refusal at the first bucket. With the error feedback, it reduces
  // otherwise than a hook given none.
  const auto other_options = PowerSGDOptions().rank(3).min_compression_rate(1).start_iteration(2).seed(7);
  PowerSGD other(other_options), without_errors(other_options);
  for (auto* hook : {&other, &without_errors}) {
    bytes.clear();
    bytes.seekg(0);
    torch::serialize::InputArchive again;
    again.load_from(bytes);
    if (hook == &other) {
      hook->load(again);
    } else {
      hook->load_shared(again);
    }
    EXPECT_EQ(hook->iteration(), 5);
  }
  auto with = bucket_of({gradient(0), torch::ones({3})});
  auto without = bucket_of({gradient(0), torch::ones({3})});
  EXPECT_NO_THROW(other(one, with)->wait());
  without_errors(one, without)->wait();
  EXPECT_FALSE(torch::equal(with.buffer, without.buffer)) << "the error feedback was not kept";
}

// A state resumed with a later start_iteration (--powersgd-start raised)
// reduced plainly and still reported the saved state's compression rate,
// in every record of the resumed run.
TEST(PowerSGD, APlainIterationAfterALoadReportsNoCompression) {
  ProcessGroup one;
  PowerSGD running(PowerSGDOptions().rank(2).start_iteration(0));
  auto bucket = bucket_of({of_rank(12, 10, 4), torch::ones({3})});
  running(one, bucket)->wait();
  ASSERT_GT(running.compression_rate(), 1.0);
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  running.save(out);
  out.save_to(bytes);
  PowerSGD later(PowerSGDOptions().rank(2).start_iteration(100));
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  later.load(in);
  auto plain = bucket_of({of_rank(12, 10, 4), torch::ones({3})});
  later(one, plain)->wait();
  EXPECT_EQ(later.compression_rate(), 0.0);
}

// One PowerSGD's state is one model's (kept by parameter index): a second
// DistributedDataParallel's buckets are refused while the first lives, and
// a model wrapped again after the first is gone takes the state on.
TEST(PowerSGD, ASecondModelIsRefusedWhileTheFirstLives) {
  ProcessGroup one;
  auto powersgd = comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(0));
  auto step = [](DistributedDataParallel<testing::OddNet>& model) {
    torch::mse_loss(model->forward(torch::ones({2, 7})), torch::zeros({2, 3})).backward();
  };
  {
    DistributedDataParallel<testing::OddNet> generator(testing::OddNet(), one, DistributedOptions().comm_hook(powersgd));
    DistributedDataParallel<testing::OddNet> critic(testing::OddNet(), one, DistributedOptions().comm_hook(powersgd));
    step(generator);
    EXPECT_ERROR_SAYS(step(critic), "comes from a second DistributedDataParallel, but one PowerSGD serves one model",
                      "Make one comm_hooks::powersgd() per DistributedDataParallel");
    EXPECT_EQ(powersgd.iteration(), 1);
  }
  DistributedDataParallel<testing::OddNet> again(testing::OddNet(), one, DistributedOptions().comm_hook(powersgd));
  step(again);
  EXPECT_EQ(powersgd.iteration(), 2);
}

// A model wrapped again once the first is destroyed (as after unfreezing a
// parameter, which shifts every index after it) takes over the iteration
// count, not the error feedback and Q's kept by the first model's indices:
// its step is that of a state that starts compressing at that iteration.
TEST(PowerSGD, AModelWrappedAgainStartsItsErrorsAndQsAfresh) {
  ProcessGroup one;
  auto make = [] {
    torch::manual_seed(3);
    return testing::OddNet();
  };
  auto step = [](DistributedDataParallel<testing::OddNet>& model) {
    model->zero_grad();
    torch::mse_loss(model->forward(torch::ones({2, 7})), torch::zeros({2, 3})).backward();
  };
  auto handed = comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(0));
  auto fresh = comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(2));
  {
    DistributedDataParallel<testing::OddNet> first(make(), one, DistributedOptions().comm_hook(handed));
    step(first);
    step(first);
  }
  DistributedDataParallel<testing::OddNet> again(make(), one, DistributedOptions().comm_hook(handed));
  step(again);
  // In the first layout, as `again`'s first step: the BLAS's bits may
  // depend on where in the bucket a matrix lies.
  DistributedDataParallel<testing::OddNet> reference(make(), one,
                                                     DistributedOptions().comm_hook(fresh).rebuild_buckets(false));
  for (int i = 0; i < 3; ++i) {
    step(reference);
  }
  EXPECT_EQ(handed.iteration(), 3);
  for (size_t i = 0; i < again->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(again->parameters()[i].grad(), reference->parameters()[i].grad())) << "parameter " << i;
  }
  // The same with a state loaded while the first model lived: once that
  // model has stepped on it, it is that model's, and is not handed on.
  auto loaded = comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(0));
  {
    DistributedDataParallel<testing::OddNet> first(make(), one, DistributedOptions().comm_hook(loaded));
    step(first);
    std::stringstream bytes;
    torch::serialize::OutputArchive out;
    loaded.save(out);
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    loaded.load(in);
    step(first);
  }
  DistributedDataParallel<testing::OddNet> after_load(make(), one, DistributedOptions().comm_hook(loaded));
  step(after_load);
  for (size_t i = 0; i < after_load->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(after_load->parameters()[i].grad(), reference->parameters()[i].grad())) << "parameter " << i;
  }
}

// Without warm start, each matrix's Q is drawn from (seed, iteration,
// parameter), so a bucket laid out otherwise (a resumed run's first step
// takes the first layout, the uninterrupted one the rebuilt) gives each
// parameter the same result. Each matrix starts 64 bytes apart in either
// order: the BLAS's bits may depend on its operands' alignment.
TEST(PowerSGD, DrawnQsDoNotDependOnTheBucketLayout) {
  ProcessGroup one;
  const auto options = PowerSGDOptions().rank(1).start_iteration(0).warm_start(false);
  PowerSGD in_order(options), swapped(options);
  for (int i = 0; i < 3; ++i) {
    auto a = of_rank(16, 8, 3, static_cast<uint64_t>(i)), b = of_rank(8, 6, 3, static_cast<uint64_t>(i + 10));
    auto first = bucket_of({a, b});
    auto second = bucket_of({b, a});
    second.parameters = {1, 0};
    in_order(one, first)->wait();
    swapped(one, second)->wait();
    EXPECT_TRUE(torch::equal(first.gradients[0], second.gradients[1])) << "iteration " << i;
    EXPECT_TRUE(torch::equal(first.gradients[1], second.gradients[0])) << "iteration " << i;
  }
}

TEST(PowerSGD, OptionsThatCannotWorkAreRefused) {
  EXPECT_NE(error_of([] { PowerSGD(PowerSGDOptions().rank(0)); }).find("rank must be at least 1, but got 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { PowerSGD(PowerSGDOptions().start_iteration(-1)); }).find("start_iteration must be >= 0"),
            std::string::npos);
}

// DDP lays its buckets out anew after the first iteration. The state is
// kept by parameter, so compressing from the start, with error feedback and
// warm start, gives every parameter what it gives when the layout never
// changes. (Kept by bucket position, the second layout would take the
// first's errors and Q's at the wrong offsets.)
TEST(PowerSGD, ARebuiltBucketLayoutFindsEachParametersState) {
  ProcessGroup one;
  auto options = PowerSGDOptions().rank(1).start_iteration(0);
  PowerSGD steady(options), rebuilt(options);
  for (int i = 0; i < 4; ++i) {
    auto a = of_rank(12, 8, 3, static_cast<uint64_t>(i)), b = of_rank(10, 6, 3, static_cast<uint64_t>(i + 10));
    auto same = bucket_of({a, b});
    steady(one, same)->wait();
    auto swapped = bucket_of({b, a}); // parameter 1 first, from the second iteration on
    swapped.parameters = {1, 0};
    if (i == 0) {
      swapped = bucket_of({a, b});
    }
    rebuilt(one, swapped)->wait();
    const auto& got_a = i == 0 ? swapped.gradients[0] : swapped.gradients[1];
    EXPECT_TRUE(torch::equal(got_a, same.gradients[0])) << "iteration " << i;
  }
}

} // namespace
} // namespace lockstep
