// ProcessGroup's contract (process_group.h) over Gloo, ranks as threads: the
// checks of support/collective_contract.h, which collectives_worker.cpp runs
// over MPI under mpirun (the Mpi.contract_* tests).

#include <lockstep/lockstep.h>

#include "support/collective_contract.h"
#include "support/errors.h"
#include "support/scoped_env.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

// Runs `checks` on `size` ranks; a failed check fails the test, naming the rank.
void on_ranks(int size, void (*checks)(const ProcessGroup&, const testing::Check&),
              std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  std::mutex mutex;
  testing::spawn(
      size,
      [&](ProcessGroup& group) {
        checks(group, [&](bool ok, const std::string& what) {
          std::lock_guard<std::mutex> lock(mutex);
          EXPECT_TRUE(ok) << "rank " << group.rank() << " of " << group.size() << ": " << what;
        });
      },
      timeout);
}

TEST(ProcessGroupContract, SeveralTensorsAreReducedAndBroadcastOneByOne) {
  on_ranks(4, testing::check_several_tensors);
  on_ranks(3, testing::check_several_tensors);
}

TEST(ProcessGroupContract, IntegerAverageRoundsDownAndBoolAverageIsRefused) {
  for (int size : {1, 2, 3, 4}) {
    on_ranks(size, testing::check_integer_average);
  }
}

TEST(ProcessGroupContract, EmptyListIsRefusedAtTheCall) {
  on_ranks(1, testing::check_empty_list);
  on_ranks(2, testing::check_empty_list);
}

TEST(ProcessGroupContract, LocalRefusalDoesNotReadAsATimeout) {
  on_ranks(1, testing::check_local_refusal);
  on_ranks(2, testing::check_local_refusal);
}

TEST(ProcessGroupContract, BFloat16AndBoolTravelExactlyOrAreRefusedAtTheCall) {
  on_ranks(1, testing::check_bfloat16_and_bool);
  on_ranks(3, testing::check_bfloat16_and_bool);
}

TEST(ProcessGroupContract, CollectivesWorkInInferenceMode) {
  on_ranks(1, testing::check_collectives_in_inference_mode);
  on_ranks(2, testing::check_collectives_in_inference_mode);
  on_ranks(3, testing::check_collectives_in_inference_mode);
}

TEST(ProcessGroupContract, InPlaceReduceScatterAndCollectivesOverParameters) {
  on_ranks(1, testing::check_in_place_and_parameters);
  on_ranks(2, testing::check_in_place_and_parameters);
  on_ranks(3, testing::check_in_place_and_parameters);
}

TEST(ProcessGroupContract, RanksPassingDifferentSizesAllFailAndNoneDies) {
  on_ranks(2, testing::check_size_mismatch, std::chrono::seconds(10));
  on_ranks(3, testing::check_size_mismatch, std::chrono::seconds(10));
}

TEST(ProcessGroupContract, RanksWhoseCallsMeanOtherThingsAllFail) {
  on_ranks(2, testing::check_meaning_mismatch, std::chrono::seconds(10));
  on_ranks(3, testing::check_meaning_mismatch, std::chrono::seconds(10));
}

// Forwards a rank's collectives to its group, counting the all_gathers (the
// agreement check's exchanges) and the rest that reach it as a backend.
class ExchangeCountingGroup : public GroupImpl {
 public:
  explicit ExchangeCountingGroup(ProcessGroup inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return inner_.backend(); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }
  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    ++others;
    return inner_.allreduce_async(tensors, op, std::move(what));
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    ++others;
    return inner_.broadcast_async(tensors, root, std::move(what));
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string) override {
    ++all_gathers;
    outputs = inner_.all_gather(input);
    return std::make_shared<Done>();
  }
  std::shared_ptr<Work> barrier(std::string) override {
    ++others;
    inner_.barrier();
    return std::make_shared<Done>();
  }
  std::atomic<int> all_gathers{0};
  std::atomic<int> others{0};

 private:
  struct Done : Work {
    void wait() override {}
  };
  ProcessGroup inner_;
};

// A backend of GPU tensors only, as NCCL's.
class GpuOnlyGroup : public ExchangeCountingGroup {
 public:
  using ExchangeCountingGroup::ExchangeCountingGroup;
  bool supports(Collective, torch::ScalarType, torch::Device device) const override {
    return device.is_cuda();
  }
};

// A backend that numbers itself wrongly: a group of `size` whose rank is `rank`.
class MisnumberedGroup : public ExchangeCountingGroup {
 public:
  MisnumberedGroup(int rank, int size) : ExchangeCountingGroup(ProcessGroup()), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

 private:
  int rank_, size_;
};

// A group of no rank, or a rank outside it, is refused where the backend is
// wrapped: DDP's micro-batch split divided by the size (SIGFPE) and FSDP's
// shards were indexed by the rank.
TEST(ProcessGroupContract, ABackendThatNumbersItselfOutOfRangeIsRefused) {
  EXPECT_ERROR_SAYS(ProcessGroup(std::make_shared<MisnumberedGroup>(0, 0)), "says it is rank 0 of 0");
  EXPECT_ERROR_SAYS(ProcessGroup(std::make_shared<MisnumberedGroup>(2, 2)), "says it is rank 2 of 2");
  EXPECT_ERROR_SAYS(ProcessGroup(std::make_shared<MisnumberedGroup>(-1, 2)), "0 <= rank() < size()");
  EXPECT_EQ(ProcessGroup(std::make_shared<MisnumberedGroup>(0, 1)).size(), 1);
}

// A CPU tensor given to a backend of GPU tensors is refused saying so; it
// was told to reduce a copy "in a type it has", float32 for a float32.
TEST(ProcessGroupContract, ACpuTensorOnAGpuOnlyBackendIsRefusedSayingWhy) {
  on_ranks(1, [](const ProcessGroup& group, const testing::Check&) {
    ProcessGroup gpu_only(std::make_shared<GpuOnlyGroup>(group));
    auto t = torch::ones({4});
    EXPECT_ERROR_SAYS(gpu_only.allreduce(t), "takes no tensors on the CPU", "t.to(torch::kCUDA)", "gloo group");
  });
}

// How long a wait on a Gloo collective polls (Note [Polling before a wait])
// is read before any rank connects: a value that is no number of
// microseconds fails every rank at once, naming the variable.
TEST(ProcessGroupContract, AGlooPollTimeThatIsNotMicrosecondsIsRefusedNamingTheVariable) {
  for (const char* bad : {"2ms", "-1", "5000000"}) {
    testing::ScopedEnv spin("LOCKSTEP_GLOO_SPIN_US", bad);
    const std::string message = testing::message_of([] { testing::spawn(2, [](ProcessGroup&) {}); });
    EXPECT_NE(message.find(std::string("LOCKSTEP_GLOO_SPIN_US=") + bad + " is not a whole number of microseconds "
                           "from 0 to 1000000"), std::string::npos) << message;
  }
  testing::ScopedEnv none("LOCKSTEP_GLOO_SPIN_US", "0"); // sleeps at once, and still sums
  testing::spawn(2, [](ProcessGroup& group) {
    auto t = torch::full({3}, double(group.rank() + 1));
    group.allreduce(t);
    EXPECT_TRUE(torch::equal(t, torch::full({3}, 3.0))) << t;
  });
}

// LOCKSTEP_DEBUG=detail is a mode of the agreement check: each collective is
// checked by the one all_gather of its fingerprint, which then also carries
// the collective's number and shape (Note [LOCKSTEP_DEBUG=detail]), and a
// mismatch still names both on every rank, with nothing sent.
TEST(ProcessGroupContract, DebugDetailChecksEachCollectiveInOneExchange) {
  testing::ScopedEnv detail("LOCKSTEP_DEBUG", "detail");
  std::mutex mutex;
  std::vector<std::string> errors(2);
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        auto counting = std::make_shared<ExchangeCountingGroup>(group);
        ProcessGroup checked(counting);
        auto t = torch::ones({4});
        checked.allreduce(t);
        checked.broadcast(t, 0);
        checked.barrier();
        EXPECT_EQ(counting->others.load(), 3) << "rank " << group.rank();
        EXPECT_EQ(counting->all_gathers.load(), 3) << "rank " << group.rank() << ": one exchange per collective";
        auto mine = torch::ones({group.rank() == 0 ? 4 : 5});
        const std::string message = testing::message_of([&] { checked.allreduce(mine); });
        EXPECT_EQ(counting->others.load(), 3) << "rank " << group.rank() << ": the mismatched allreduce was sent";
        EXPECT_EQ(counting->all_gathers.load(), 4) << "rank " << group.rank() << ": one exchange per collective";
        std::lock_guard<std::mutex> lock(mutex);
        errors[group.rank()] = message;
      },
      std::chrono::seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("allreduce: LOCKSTEP_DEBUG=detail: ranks disagree on collective #3: rank 0 runs allreduce "
                             "(sum) of [4] Float but rank 1 runs allreduce (sum) of [5] Float"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// The reducer's view of the same fault: ranks that disagree on bucket_cap_mb
// reduce buckets of different sizes. Every rank ends with an error naming
// the bucket's allreduce, none dies.
TEST(ProcessGroupContract, DdpWhoseRanksDisagreeOnBucketSizesFailsOnEveryRank) {
  // Caught at construction, before any bucket is sent (the options check of
  // verify_same_parameters); the size check above catches the rest.
  std::mutex mutex;
  std::vector<std::string> errors(2);
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        torch::manual_seed(3);
        auto net = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 4));
        // Rank 0: every parameter its own bucket; rank 1: one bucket of all.
        auto options = DistributedOptions().bucket_cap_mb(group.rank() == 0 ? 1e-6 : 25.0);
        const std::string message =
            testing::message_of([&] { DistributedDataParallel<torch::nn::Sequential> ddp(net, group, options); });
        std::lock_guard<std::mutex> lock(mutex);
        errors[group.rank()] = message;
      },
      std::chrono::seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 1's DistributedOptions differ from rank 0's: rank 0 has bucket_bytes=1,"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// float16's Avg of two 40000s is 40000, not the inf their float16 sum
// (above 65504) divided by 2; the inputs keep their values until the end.
TEST(ProcessGroupContract, HalfAveragesDoNotOverflowWhereTheAverageFits) {
  testing::spawn(2, [](ProcessGroup& group) {
    const auto big = torch::full({4}, 40000.0, torch::kHalf);
    auto t = big.clone();
    group.allreduce_async({t}, ReduceOp::Avg)->wait();
    EXPECT_TRUE(torch::equal(t, big)) << t;
    auto a = big.clone();
    auto b = big.narrow(0, 0, 2).clone();
    group.allreduce_async({a, b}, ReduceOp::Avg)->wait();
    EXPECT_TRUE(torch::equal(b, big.narrow(0, 0, 2))) << b;
    const auto input = big.clone();
    auto out = torch::empty({2}, torch::kHalf);
    group.reduce_scatter_async(out, input, ReduceOp::Avg)->wait();
    EXPECT_TRUE(torch::equal(out, big.narrow(0, 0, 2))) << out;
    EXPECT_TRUE(torch::equal(input, big)) << "the input was changed";
    // Tensors of any shape, a scalar too: the division's copy was read back
    // as if 1-D, and wait() failed on the narrow.
    auto square = torch::full({2, 2}, 40000.0, torch::kHalf);
    group.allreduce(square, ReduceOp::Avg);
    EXPECT_TRUE(torch::equal(square, torch::full({2, 2}, 40000.0, torch::kHalf))) << square;
    auto scalar = torch::scalar_tensor(2.0 * (group.rank() + 1), torch::kHalf);
    group.allreduce(scalar, ReduceOp::Avg);
    EXPECT_EQ(scalar.dim(), 0);
    EXPECT_EQ(scalar.item<float>(), 3.0f);
  });
}

// A group made again over the store of the one before (after a failure,
// as the errors advise) read the earlier group's rendezvous keys: rank 0
// took rank 1's closed listener for its new one, and connected to it or
// waited for it by the order of the two addresses, so a round failed at
// the timeout about one time in four (Note [One store, several groups]).
// Six rounds, each with rank 1 late, so that rank 0 reads first.
// Note [Every rank has connected] (src/comm/backends/gloo.cpp): ranks that
// drop their group as soon as they have it never fail another rank's join.
// The race it closes is narrow: without the fix, one join in a few hundred
// failed on a loaded 2-core machine, so this test does not catch it every time.
TEST(ProcessGroupContract, GroupsDroppedRightAfterJoiningNeverFailAnotherRanksJoin) {
  for (int round = 0; round < 100; ++round) {
    testing::spawn(2, [](ProcessGroup& group) { EXPECT_EQ(group.size(), 2); });
  }
}

TEST(ProcessGroupContract, GroupsMadeOneAfterAnotherOverOneStoreMeetTheirOwnRanks) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  constexpr int kRounds = 6;
  std::vector<std::string> errors(2);
  std::vector<std::vector<float>> sums(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      errors[rank] = testing::error_of([&] {
        for (int round = 0; round < kRounds; ++round) {
          if (rank == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
          }
          auto group = new_group(store, rank, 2, "gloo", std::chrono::seconds(5));
          auto t = torch::full({2}, rank + 1.0 + round);
          group.allreduce(t);
          sums[rank].push_back(t[1].item<float>());
        }
      });
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    ASSERT_EQ(sums[r].size(), static_cast<size_t>(kRounds)) << "rank " << r;
    for (int round = 0; round < kRounds; ++round) {
      EXPECT_EQ(sums[r][round], 3.0f + 2 * round) << "rank " << r << ", round " << round;
    }
  }
}

// Rank 1 is alive but never joins (stuck elsewhere). Rank 0's first
// collective fails after the timeout; the three queued behind it fail at
// once, naming it as the cause, and are never sent (Note [A group whose
// collective failed]); so does the next one started.
TEST(ProcessGroupContract, CollectivesBehindAFailedOneFailAtOnceNamingIt) {
  const auto timeout = std::chrono::seconds(2);
  std::promise<void> done;
  auto finished = done.get_future().share();
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        if (group.rank() == 1) {
          finished.wait();
          return;
        }
        std::vector<std::shared_ptr<Work>> works;
        for (int i = 0; i < 4; ++i) {
          works.push_back(group.allreduce_async({torch::ones({4})}, ReduceOp::Sum, "bucket " + std::to_string(i)));
        }
        const auto start = std::chrono::steady_clock::now();
        EXPECT_ERROR_SAYS(works[0]->wait(), "bucket 0 failed or did not complete within the group's timeout");
        for (int i = 1; i < 4; ++i) {
          EXPECT_ERROR_SAYS(works[i]->wait(), "was not sent: an earlier collective of this group failed",
                            "The first failure: bucket 0");
        }
        EXPECT_ERROR_SAYS(group.allreduce_async({torch::ones({4})})->wait(), "The first failure: bucket 0");
        const auto waited = std::chrono::steady_clock::now() - start;
        EXPECT_LT(waited, 2 * timeout) << "the queued collectives waited a timeout each";
        done.set_value();
      },
      timeout);
}

TEST(ProcessGroupContract, NcclGroupOfOneKeepsTheContract_CUDA) {
  // NCCL refuses two ranks on one GPU, so a real NCCL group of one: several
  // tensors on one device are reduced and broadcast one by one (c10d's NCCL
  // would read a list as one tensor per device), an integer average keeps its
  // type, and an empty list is refused at the call.
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const auto gpu = torch::TensorOptions().device(torch::kCUDA, 0);
  auto group = new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "nccl");
  ASSERT_EQ(group.backend(), "nccl");
  auto a = torch::full({1}, 1.0f, gpu);
  auto b = torch::full({2}, 4.0f, gpu);
  group.allreduce_async({a, b}, ReduceOp::Sum, "two tensors")->wait();
  EXPECT_TRUE(torch::equal(a.cpu(), torch::full({1}, 1.0f))) << a;
  EXPECT_TRUE(torch::equal(b.cpu(), torch::full({2}, 4.0f))) << b;
  group.broadcast_async({a, b}, 0, "two tensors")->wait();
  EXPECT_TRUE(torch::equal(b.cpu(), torch::full({2}, 4.0f))) << b;
  auto longs = torch::full({3}, int64_t{-3}, gpu.dtype(torch::kLong));
  group.allreduce_async({longs}, ReduceOp::Avg, "integer average")->wait();
  EXPECT_EQ(longs.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(longs.cpu(), torch::full({3}, int64_t{-3}))) << longs;
  const auto message = testing::message_of([&] { group.allreduce_async({}, ReduceOp::Sum, "empty allreduce"); });
  EXPECT_NE(message.find("no tensors"), std::string::npos) << message;
  // NCCL has no 16-bit integers: a broadcast carries them as Half's bits
  // (DDP's first broadcast of an int16 buffer), and a sum is refused by name.
  auto shorts = torch::full({3}, int16_t{-7}, gpu.dtype(torch::kShort));
  group.broadcast_async({shorts}, 0, "int16 broadcast")->wait();
  EXPECT_TRUE(torch::equal(shorts.cpu(), torch::full({3}, int16_t{-7}))) << shorts;
  EXPECT_FALSE(group.supports(Collective::Allreduce, torch::kShort, torch::kCUDA));
}

} // namespace
} // namespace lockstep
