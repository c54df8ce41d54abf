// Planned collectives over Gloo, ranks as threads (Note [Planned collectives]
// in src/comm/planned_collective.cpp): a plan that differs between ranks
// fails when it is agreed, an agreed plan's allreduces go without the check
// before each and carry words, and words that differ are an error on every
// rank once the allreduce completes.

#include <lockstep/lockstep.h>

#include "comm/planned_collective.h"
#include "ddp/reducer.h"
#include "support/collective_contract.h"
#include "support/powersgd_checks.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace planned_test {

constexpr int64_t kGradients = 1000;

std::shared_ptr<Work> planned_allreduce(const ProcessGroup& group, torch::Tensor& bucket, int64_t plan, int64_t item,
                                        const std::string& what) {
  detail::PlannedCollective planned(plan, item);
  return group.allreduce_async({bucket}, ReduceOp::Sum, what);
}

// An agreed plan of two items of the same size, each a gradient bucket with
// room for the words, which the group has switched to: its first item goes
// checked (Note [A switch of plans is checked]), and every later one planned.
int64_t two_item_plan(const ProcessGroup& group) {
  const int64_t elements = kGradients + detail::plan_words_elements(group.size());
  const int64_t plan = detail::agree_on_plan(group, "the test's plan",
                                             {{elements, torch::kFloat}, {elements, torch::kFloat}}, torch::kCPU, "");
  auto bucket = torch::zeros({elements});
  planned_allreduce(group, bucket, plan, 0, "the plan's first item")->wait();
  return plan;
}

torch::Tensor words_of(const torch::Tensor& bucket, const ProcessGroup& group) {
  return bucket.narrow(0, kGradients, detail::plan_words_elements(group.size()));
}

// The bucket plan of DistributedDataParallel's reducer is agreed when it is
// made: a rank whose buckets differ fails there, with every other rank,
// before any bucket is sent. (DistributedDataParallel's own options check
// catches a bucket_cap_mb that differs before its reducer is made: this is
// the reducer alone, as a rank whose plan differs for any other reason.)
TEST(PlannedCollectives, ABucketPlanThatDiffersOnOneRankFailsOnEveryRank) {
  const auto errors = testing::strings_by_rank(3, [](ProcessGroup& group) {
    torch::manual_seed(1);
    auto net = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 4));
    std::vector<std::string> names;
    for (const auto& item : net->named_parameters()) {
      names.push_back(item.key());
    }
    const auto options = DistributedOptions().bucket_cap_mb(group.rank() == 2 ? 1e-6 : 25.0);
    return testing::message_of([&] { detail::Reducer reducer(net->parameters(), names, group, options); });
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 3: ranks disagree on DistributedDataParallel's "
                             "buckets, so none of them was sent: rank 0 plans 1 ("),
              std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("but rank 2 plans 4 ("), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("bucket_cap_mb"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// Over Gloo, an agreed plan's allreduce goes without a check before it: it
// carries every rank's words, which read back equal. Under
// LOCKSTEP_DEBUG=detail it is checked as any other, and its room stays zero.
TEST(PlannedCollectives, GoUncheckedOverGlooCarryingWordsAndCheckedUnderDebugDetail) {
  for (const bool detail : {false, true}) {
    if (detail) {
      setenv("LOCKSTEP_DEBUG", "detail", 1);
    }
    testing::spawn(3, [&](ProcessGroup& group) {
      const int64_t plan = two_item_plan(group);
      for (int step = 0; step < 3; ++step) {
        for (int64_t item = 0; item < 2; ++item) {
          auto bucket = torch::full({kGradients + detail::plan_words_elements(group.size())}, 1.0f);
          planned_allreduce(group, bucket, plan, item, "allreduce of bucket " + std::to_string(item))->wait();
          EXPECT_TRUE(bucket.narrow(0, 0, kGradients).eq(3).all().item<bool>()) << "rank " << group.rank();
          const auto words = words_of(bucket, group);
          EXPECT_EQ(detail::plan_words_disagreement(words, group.size()), "");
          EXPECT_EQ(words.abs().sum().item<float>() == 0, detail) << "rank " << group.rank() << ": the words "
                                                                  << (detail ? "travelled under detail" : "are missing");
        }
      }
    });
    unsetenv("LOCKSTEP_DEBUG");
  }
}

// Two DistributedDataParallel models whose backwards one rank runs in the
// other order meet bucket for bucket: of one layout, with the same sizes; of
// two, with other sizes, which Gloo's own thread would end the process on.
// A switch of plans keeps the check (Note [A switch of plans is checked]):
// the rank that switches is at a check, which the other's planned bucket
// never pairs with, and both fail at the group's timeout, each naming its
// bucket. Under LOCKSTEP_DEBUG=detail every bucket is checked, and the
// check names both wrappers' numbers (Note [Collective tags]). Never one
// model's gradients added to the other's, nor an abort.
TEST(PlannedCollectives, TwoModelsWhoseBackwardsRunInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  for (const bool detail : {false, true}) {
    for (const int64_t width : {64, 96}) {
      if (detail) {
        setenv("LOCKSTEP_DEBUG", "detail", 1);
      }
      testing::spawn(2, [&](ProcessGroup& group) {
        torch::manual_seed(3);
        DistributedDataParallel<torch::nn::Linear> first(torch::nn::Linear(64, 64), group);
        DistributedDataParallel<torch::nn::Linear> second(torch::nn::Linear(64, width), group);
        const auto x = torch::randn({4, 64});
        for (int step = 0; step < 2; ++step) { // the buckets' plans agreed, and sent as planned
          first->forward(x).sum().backward();
          second->forward(x).sum().backward();
        }
        auto a = first->forward(x).sum();
        auto b = second->forward(x).sum();
        auto run = [&] {
          (group.rank() == 1 ? b : a).backward();
          (group.rank() == 1 ? a : b).backward();
        };
        if (detail) {
          EXPECT_ERROR_SAYS(run(), "ranks disagree on collective", "of wrapped model ");
        } else {
          EXPECT_ERROR_SAYS(run(), "allreduce of ", "did not complete within the group's timeout");
        }
      }, std::chrono::seconds(3));
      unsetenv("LOCKSTEP_DEBUG");
    }
  }
}

// Two ranks that send other items of the plan, of the same size: both
// allreduces complete, and every rank's wait() throws, naming its collective
// and both items; the ranks stay paired, so the group goes on.
TEST(PlannedCollectives, AnotherItemOnOneRankIsAnErrorOnEveryRankOnceItCompletes) {
  const auto errors = testing::strings_by_rank(2, [](ProcessGroup& group) {
    const int64_t plan = two_item_plan(group);
    auto bucket = torch::ones({kGradients + detail::plan_words_elements(group.size())});
    const int64_t item = group.rank();
    const std::string error = testing::message_of(
        [&] { planned_allreduce(group, bucket, plan, item, "allreduce of bucket " + std::to_string(item))->wait(); });
    auto after = torch::full({5}, static_cast<float>(group.rank()));
    group.allreduce(after);
    EXPECT_TRUE(after.eq(1).all().item<bool>()) << "rank " << group.rank() << ": the group did not go on";
    return error;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 2: allreduce of bucket " + std::to_string(r) +
                             ": ranks disagree on this collective, found once it completed, so its result is not "
                             "used: rank 0 sent item 0 of plan "),
              std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("(the test's plan) as its collective #2 but rank 1 sent item 1 of plan"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// A planned allreduce that meets another rank's checked collective moves no
// bytes (Gloo pairs only collectives of one kind): both fail at the group's
// timeout, each naming its own, and no process dies.
TEST(PlannedCollectives, APlannedAllreduceMeetingACheckedOneFailsAtTheTimeoutOnEveryRank) {
  const auto errors = testing::strings_by_rank(
      2,
      [](ProcessGroup& group) {
        const int64_t plan = two_item_plan(group);
        auto bucket = torch::ones({kGradients + detail::plan_words_elements(group.size())});
        return testing::message_of([&] {
          if (group.rank() == 0) {
            planned_allreduce(group, bucket, plan, 0, "allreduce of bucket 0")->wait();
          } else {
            group.allreduce_async({bucket}, ReduceOp::Sum, "an allreduce of the caller's")->wait();
          }
        });
      },
      std::chrono::seconds(3));
  EXPECT_NE(errors[0].find("allreduce of bucket 0"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("an allreduce of the caller's"), std::string::npos) << errors[1];
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 2"), std::string::npos) << errors[r];
  }
}

// A planned average read twice (PowerSGD's rounds share one Q allreduce,
// and each waits on it): the words are read once, at the first wait(),
// before the average divides the room with the rest.
TEST(PlannedCollectives, APlannedAverageCanBeWaitedOnAgain) {
  testing::spawn(3, [](ProcessGroup& group) {
    const int64_t plan = two_item_plan(group);
    auto bucket = torch::full({kGradients + detail::plan_words_elements(group.size())}, 3.0f);
    std::shared_ptr<Work> work;
    {
      detail::PlannedCollective planned(plan, 0);
      work = group.allreduce_async({bucket}, ReduceOp::Avg, "an average of bucket 0");
    }
    work->wait();
    work->wait();
    EXPECT_TRUE(bucket.narrow(0, 0, kGradients).eq(3).all().item<bool>()) << "rank " << group.rank();
  });
}

// A planned average that the backend divides (GroupImpl::averages, Gloo's
// threads through shared memory): each rank's words go in times the group's
// size, and the division gives them back exactly at 3 ranks too; another
// item on one rank is still an error on every rank that names both.
TEST(PlannedCollectives, APlannedAverageThatTheBackendDividesCarriesItsWordsExactly) {
  if (const char* shm = std::getenv("LOCKSTEP_GLOO_SHM"); shm != nullptr && std::string(shm) == "0") {
    GTEST_SKIP() << "LOCKSTEP_GLOO_SHM=0: the group does not go through shared memory";
  }
  const auto errors = testing::strings_by_rank(3, [](ProcessGroup& group) {
    EXPECT_TRUE(group.averages_in_backend(torch::kFloat));
    const int64_t plan = two_item_plan(group);
    auto average = [&](int64_t item, torch::Tensor& bucket) {
      detail::PlannedCollective planned(plan, item);
      group.allreduce_async({bucket}, ReduceOp::Avg, "an average of bucket " + std::to_string(item))->wait();
    };
    auto bucket = torch::full({kGradients + detail::plan_words_elements(group.size())}, 3.0f * (group.rank() + 1));
    average(1, bucket);
    EXPECT_TRUE(bucket.narrow(0, 0, kGradients).eq(6).all().item<bool>()) << "rank " << group.rank();
    EXPECT_EQ(detail::plan_words_disagreement(words_of(bucket, group), group.size()), "");
    EXPECT_GT(words_of(bucket, group).abs().sum().item<float>(), 0) << "the words are missing";
    return testing::message_of([&] { average(group.rank() == 2 ? 0 : 1, bucket); });
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("ranks disagree on this collective, found once it completed"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("but rank 2 sent item 0 of plan"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// Note [Recurring plans]: the first iteration is recorded and checked, the
// next agrees on it and goes planned, item by item, until an item differs;
// from there the iteration is checked, and the one after agrees anew.
TEST(PlannedCollectives, ARecurringPlanIsWhatTheLastIterationSentUntilAnItemDiffers) {
  using Sent = std::vector<std::pair<int64_t, int64_t>>;
  std::vector<Sent> sent(2);
  testing::spawn(2, [&](ProcessGroup& group) {
    detail::RecurringPlan plan("the test's collectives", "");
    const detail::PlanItem a{100, torch::kFloat}, b{40, torch::kFloat}, c{40, torch::kHalf};
    for (const auto& items : std::vector<std::vector<detail::PlanItem>>{{a, b}, {a, b}, {a, c, b}, {a, c, b}, {a}}) {
      plan.start_iteration(group, torch::kCPU);
      for (const auto& item : items) {
        sent[group.rank()].push_back(plan.next(item));
      }
    }
  });
  EXPECT_EQ(sent[0], sent[1]);
  const auto& s = sent[0];
  ASSERT_EQ(s.size(), 11u);
  const int64_t first = s[2].first, second = s[7].first;
  EXPECT_GE(first, 0);
  EXPECT_GE(second, 0);
  EXPECT_NE(first, second);
  const Sent expected{{-1, 0}, {-1, 1}, {first, 0}, {first, 1}, {first, 0}, {-1, 1}, {-1, 2},
                      {second, 0}, {second, 1}, {second, 2}, {second, 0}};
  EXPECT_EQ(s, expected);
}

// A rank whose iteration sent other collectives than the others' fails with
// every rank when they agree, before any of the next iteration's is sent.
TEST(PlannedCollectives, ARecurringPlanThatDiffersOnOneRankFailsOnEveryRankWhenAgreed) {
  const auto errors = testing::strings_by_rank(3, [](ProcessGroup& group) {
    detail::RecurringPlan plan("the test's collectives", "Look at the test.");
    plan.start_iteration(group, torch::kCPU);
    plan.next({100, torch::kFloat});
    plan.next({group.rank() == 2 ? int64_t{41} : int64_t{40}, torch::kFloat});
    return testing::message_of([&] { plan.start_iteration(group, torch::kCPU); });
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 3: ranks disagree on the test's collectives, so "
                             "none of them was sent: rank 0 plans 2 (140 elements): [100 Float, 40 Float] but "
                             "rank 2 plans 2 (141 elements): [100 Float, 41 Float]. Look at the test."),
              std::string::npos)
        << errors[r];
  }
}

// PowerSGD's P's and Q's go as a recurring plan: bucket layouts that change
// on every rank (a rebuild) leave the plan and are agreed anew, and every
// iteration's compressed average stays exact where it can be (rank-3
// matrices at rank 3), in both buckets, which share one Q allreduce.
TEST(PlannedCollectives, PowerSGDsAllreducesStayExactThroughALayoutThatChangesOnEveryRank) {
  testing::spawn(3, [](ProcessGroup& group) {
    PowerSGD powersgd(PowerSGDOptions().rank(3).start_iteration(0).error_feedback(false).warm_start(false));
    auto generator = at::detail::createCPUGenerator(11); // the same on every rank
    for (const int64_t rows : {16, 16, 24, 24, 24}) {
      std::vector<GradBucket> buckets;
      std::vector<torch::Tensor> means;
      for (size_t b = 0; b < 2; ++b) {
        auto left = torch::randn({rows + static_cast<int64_t>(b), 3}, generator, torch::kFloat);
        auto right = torch::randn({10, 3}, generator, torch::kFloat);
        means.push_back(torch::matmul(left, (right + 1).t())); // ranks 0, 1 and 2 hold right + 0, 1, 2
        buckets.push_back(
            testing::bucket_of({torch::matmul(left, (right + group.rank()).t()), torch::full({5}, group.rank())}));
        buckets[b].index = b;
        buckets[b].last = b == 1;
        buckets[b].parameters = {2 * b, 2 * b + 1};
        buckets[b].name = "bucket " + std::to_string(b);
      }
      std::vector<std::shared_ptr<PendingReduction>> pending;
      for (auto& bucket : buckets) {
        pending.push_back(powersgd(group, bucket));
      }
      for (size_t b = 0; b < 2; ++b) {
        pending[b]->wait();
        const auto& mean = means[b];
        const double error = (buckets[b].gradients[0] - mean).abs().max().item<double>();
        EXPECT_LT(error, 1e-4 * mean.abs().max().item<double>()) << "rank " << group.rank() << ", bucket " << b;
        EXPECT_TRUE(torch::equal(buckets[b].gradients[1], torch::ones({5}))) << "rank " << group.rank();
      }
    }
  });
}

} // namespace planned_test
} // namespace lockstep
