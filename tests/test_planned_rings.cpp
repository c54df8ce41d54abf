// Planned all-gathers and reduce-scatters over Gloo, ranks as threads (Note
// [Planned rings] in src/comm/planned_collective.cpp): they go without the
// check before each, carrying every rank's words beside their data; words
// that differ are an error on every rank once the ring completes; a planned
// ring that meets a checked collective fails at the timeout on every rank.
// And FullyShardedDataParallel's backward goes as such a plan.

#include <lockstep/lockstep.h>

#include "comm/collective_fingerprint.h"
#include "comm/planned_collective.h"
#include "support/collective_contract.h"
#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <vector>

namespace lockstep {
namespace planned_rings_test {

constexpr int64_t kShard = 1000;

std::shared_ptr<Work> planned_gather(const ProcessGroup& group, torch::Tensor& out, const torch::Tensor& mine,
                                     int64_t plan, int64_t item) {
  detail::PlannedCollective planned(plan, item);
  return group.all_gather_into_async(out, mine, "all_gather of item " + std::to_string(item));
}

std::shared_ptr<Work> planned_reduce_scatter(const ProcessGroup& group, torch::Tensor& out, const torch::Tensor& in,
                                             int64_t plan, int64_t item) {
  detail::PlannedCollective planned(plan, item);
  return group.reduce_scatter_async(out, in, ReduceOp::Sum, "reduce_scatter of item " + std::to_string(item));
}

// An agreed plan of an all-gather and a reduce-scatter, each of two items of
// one size, in the order: gather, gather, reduce-scatter, reduce-scatter;
// the group has switched to it (its first item went checked: Note [A switch
// of plans is checked]), so every later item goes planned.
int64_t ring_plan(const ProcessGroup& group) {
  using detail::fingerprint::kAllGather;
  using detail::fingerprint::kReduceScatter;
  const int64_t whole = kShard * group.size();
  const int64_t plan =
      detail::agree_on_plan(group, "the test's rings",
                            {{kShard, torch::kFloat, kAllGather, 0}, {kShard, torch::kFloat, kAllGather, 0},
                             {whole, torch::kFloat, kReduceScatter, 0}, {whole, torch::kFloat, kReduceScatter, 0}},
                            torch::kCPU, "");
  auto out = torch::empty({whole});
  planned_gather(group, out, torch::zeros({kShard}), plan, 0)->wait();
  return plan;
}

// Three ranks, so that words pass through a rank on their way: each planned
// ring gives the collective's result, and its words read back equal (a
// difference would throw from wait()). Rank r's shard holds r + 1.
TEST(PlannedRings, GiveTheirResultsCarryingEveryRanksWords) {
  testing::spawn(3, [](ProcessGroup& group) {
    const int64_t plan = ring_plan(group);
    const auto rank = static_cast<float>(group.rank());
    const auto expected_gather = torch::arange(1, 4, torch::kFloat).repeat_interleave(kShard);
    for (int step = 0; step < 2; ++step) {
      for (int64_t item = 0; item < 2; ++item) {
        auto out = torch::empty({kShard * 3});
        planned_gather(group, out, torch::full({kShard}, rank + 1), plan, item)->wait();
        EXPECT_TRUE(torch::equal(out, expected_gather)) << "rank " << group.rank();
      }
      for (int64_t item = 2; item < 4; ++item) {
        auto in = torch::arange(kShard * 3, torch::kFloat) + rank;
        auto out = torch::empty({kShard});
        planned_reduce_scatter(group, out, in, plan, item)->wait();
        const auto sum = 3 * torch::arange(kShard * group.rank(), kShard * (group.rank() + 1), torch::kFloat) + 3;
        EXPECT_TRUE(torch::equal(out, sum)) << "rank " << group.rank();
      }
    }
  });
}

// Rank 2 gathers another item of the plan, of the same size: every ring
// completes, and every rank's wait() throws, naming both items. The ranks
// stay paired, so the group goes on.
TEST(PlannedRings, AnotherItemOnOneRankIsAnErrorOnEveryRankOnceTheRingCompletes) {
  const auto errors = testing::strings_by_rank(3, [](ProcessGroup& group) {
    const int64_t plan = ring_plan(group);
    auto out = torch::empty({kShard * 3});
    const int64_t item = group.rank() == 2 ? 1 : 0;
    const std::string error =
        testing::message_of([&] { planned_gather(group, out, torch::ones({kShard}), plan, item)->wait(); });
    auto after = torch::full({5}, static_cast<float>(group.rank()));
    group.allreduce(after);
    EXPECT_TRUE(after.eq(3).all().item<bool>()) << "rank " << group.rank() << ": the group did not go on";
    return error;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 3: all_gather of item " + (r == 2 ? "1" : "0") +
                             ": ranks disagree on this collective, found once it completed, so its result is not "
                             "used: rank 0 sent item 0 of plan "),
              std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("(the test's rings) as its collective #2 but rank 2 sent item 1 of plan"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// A planned reduce-scatter that meets another rank's checked one moves no
// bytes: both fail at the group's timeout, each naming its own, and no
// process dies (Gloo would abort on a message of another size).
TEST(PlannedRings, APlannedRingMeetingACheckedCollectiveFailsAtTheTimeoutOnEveryRank) {
  const auto errors = testing::strings_by_rank(
      2,
      [](ProcessGroup& group) {
        const int64_t plan = ring_plan(group);
        return testing::message_of([&] {
          auto in = torch::ones({kShard * 2});
          auto out = torch::empty({kShard});
          if (group.rank() == 0) {
            planned_reduce_scatter(group, out, in, plan, 2)->wait();
          } else {
            auto other = torch::ones({kShard * 4});
            auto half = torch::empty({kShard * 2});
            group.reduce_scatter_async(half, other, ReduceOp::Sum, "a reduce_scatter of the caller's")->wait();
          }
        });
      },
      std::chrono::seconds(3));
  EXPECT_NE(errors[0].find("reduce_scatter of item 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("a reduce_scatter of the caller's"), std::string::npos) << errors[1];
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 2"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("within the group's timeout"), std::string::npos) << errors[r];
  }
}

struct TwoUnitsImpl : torch::nn::Module {
  TwoUnitsImpl() {
    a = register_module("a", torch::nn::Linear(256, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(torch::tanh(a(x)));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoUnits);

// FullyShardedDataParallel's backward goes as a recurring plan: a rank that
// leaves it (here no_sync() on rank 1 alone, at the third step, so that
// rank 0 reduce-scatters and rank 1 does not) fails with every other rank,
// each naming its own collective, within the group's timeout.
TEST(PlannedRings, AShardedBackwardThatDiffersOnOneRankFailsOnEveryRankWithinTheTimeout) {
  const auto errors = testing::strings_by_rank(
      2,
      [](ProcessGroup& group) {
        torch::manual_seed(3);
        FullyShardedDataParallel<TwoUnits> model(TwoUnits(), group,
                                                 ShardingOptions().units({"a", "b"}));
        torch::optim::SGD sgd(model->parameters(), 0.1);
        return testing::message_of([&] {
          for (int step = 0; step < 4; ++step) {
            sgd.zero_grad();
            auto loss = [&] { model->forward(torch::randn({4, 256})).pow(2).mean().backward(); };
            if (step == 2 && group.rank() == 1) {
              auto guard = model->no_sync();
              loss();
            } else {
              loss();
            }
            sgd.step();
          }
        });
      },
      std::chrono::seconds(3));
  EXPECT_NE(errors[0].find("rank 0 of 2: reduce_scatter of"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 1 of 2: all_gather of"), std::string::npos) << errors[1];
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("within the group's timeout"), std::string::npos) << errors[r];
  }
}

// Two FullyShardedDataParallel models whose forwards run in one order and
// whose backwards one rank runs in the other: the rank that switches plans
// is at a check (Note [A switch of plans is checked]), which the other's
// planned ring never pairs with, so their rings never meet, which with other
// sizes Gloo's own thread would end the process on. Every rank fails at the
// group's timeout, naming its collective.
TEST(PlannedRings, TwoShardedModelsWhoseBackwardsRunInAnotherOrderOnOneRankFailOnEveryRankWithinTheTimeout) {
  for (const int64_t width : {64, 96}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::manual_seed(3);
      FullyShardedDataParallel<torch::nn::Linear> first(torch::nn::Linear(64, 64), group);
      FullyShardedDataParallel<torch::nn::Linear> second(torch::nn::Linear(64, width), group);
      const auto x = torch::randn({4, 64});
      for (int step = 0; step < 3; ++step) { // the backwards' plans agreed, and sent as planned
        first->forward(x).sum().backward();
        second->forward(x).sum().backward();
      }
      auto a = first->forward(x).sum();
      auto b = second->forward(x).sum();
      EXPECT_ERROR_SAYS([&] {
        (group.rank() == 1 ? b : a).backward();
        (group.rank() == 1 ? a : b).backward();
      }(), "reduce_scatter of root", "did not complete within the group's timeout");
    }, std::chrono::seconds(3));
  }
}

} // namespace planned_rings_test
} // namespace lockstep
