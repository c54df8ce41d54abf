// Collectives through shared memory (Note [Collectives through shared memory]
// in src/comm/backends/shared_memory_collectives.cpp), with ranks as threads:
// through the Gloo group, and the transport alone, over an in-memory store.

#include <lockstep/lockstep.h>

#include "comm/backends/same_host.h"
#include "comm/backends/shared_memory_collectives.h"
#include "comm/backends/shared_memory_segments.h"
#include "support/errors.h"
#include "support/scoped_env.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

using detail::SharedMemoryCollectives;

// Runs fn(rank, transport) on `size` threads over one store; the transport
// may be null (where connect declined).
void on_transports(int size, std::chrono::milliseconds timeout,
                   const std::function<void(int, SharedMemoryCollectives*)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto transport = SharedMemoryCollectives::connect(*store, rank, size, timeout);
      fn(rank, transport.get());
    });
  }
  for (auto& t : threads) {
    t.join();
  }
}

// Rank r's values: small integers, which every dtype here (Half: up to
// 2048) holds and sums exactly over three ranks.
torch::Tensor values_of(int rank, int64_t numel, torch::ScalarType dtype) {
  return (torch::arange(numel, torch::kLong).remainder(31) * (rank + 1) - 30 * rank).to(dtype);
}

TEST(SharedMemoryCollectives, PiecesLargerThanASegmentSumExactlyOnEveryRankThroughTheGroup) {
  // 3 M floats are 12 MiB: pieces of a segment (8 MiB for two ranks, 5.3
  // for three), and one rank's slice of the last piece is shorter than the
  // others'.
  for (int size : {2, 3}) {
    // Half, which every LibTorch's Gloo reduces (1.13's has no BFloat16).
    for (auto dtype : {torch::kFloat, torch::kLong, torch::kHalf}) {
      const int64_t numel = dtype == torch::kHalf ? 5000001 : 3000001;
      auto expected = torch::zeros({numel}, torch::kLong);
      for (int r = 0; r < size; ++r) {
        expected += values_of(r, numel, torch::kLong);
      }
      std::mutex mutex;
      testing::spawn(size, [&](ProcessGroup& group) {
        auto t = values_of(group.rank(), numel, dtype);
        group.allreduce(t, ReduceOp::Sum);
        std::lock_guard<std::mutex> lock(mutex);
        EXPECT_TRUE(torch::equal(t.to(torch::kLong), expected))
            << "rank " << group.rank() << " of " << size << ", " << dtype;
      });
    }
  }
}

TEST(SharedMemoryCollectives, MaxAndMinTakeEveryRanksExtremes) {
  std::mutex mutex;
  testing::spawn(3, [&](ProcessGroup& group) {
    const int r = group.rank();
    auto high = torch::tensor({double(r), -double(r), r == 1 ? 7.0 : 0.0});
    auto low = high.clone();
    group.allreduce(high, ReduceOp::Max);
    group.allreduce(low, ReduceOp::Min);
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_TRUE(torch::equal(high, torch::tensor({2.0, 0.0, 7.0}))) << high;
    EXPECT_TRUE(torch::equal(low, torch::tensor({0.0, -2.0, 0.0}))) << low;
  });
}

TEST(SharedMemoryCollectives, ConnectsOnEveryRankOrOnNone) {
  std::mutex mutex;
  std::vector<bool> connected(3);
  on_transports(3, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
    std::lock_guard<std::mutex> lock(mutex);
    connected[rank] = transport != nullptr;
  });
  EXPECT_EQ(connected, std::vector<bool>(3, true));
  {
    testing::ScopedEnv off("LOCKSTEP_GLOO_SHM", "0");
    on_transports(3, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
      std::lock_guard<std::mutex> lock(mutex);
      connected[rank] = transport != nullptr;
    });
  }
  EXPECT_EQ(connected, std::vector<bool>(3, false));
}

// Sizes agreed by the check, or by a plan, never differ here; if they did,
// every rank says so at once, and later allreduces fail rather than read
// another collective's bytes.
TEST(SharedMemoryCollectives, RanksWhoseAllreducesDifferAllFailNamingBoth) {
  std::mutex mutex;
  std::vector<std::string> first(2), later(2);
  on_transports(2, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    auto t = torch::ones({rank == 0 ? 10 : 12});
    const auto a = testing::error_of([&] { transport->allreduce(t, ReduceOp::Sum); });
    const auto b = testing::error_of([&] { transport->allreduce(torch::ones({10}), ReduceOp::Sum); });
    std::lock_guard<std::mutex> lock(mutex);
    first[rank] = a;
    later[rank] = b;
  });
  EXPECT_NE(first[0].find("rank 1's collective is an allreduce of 12 elements of Float (sum) where rank 0's is an "
                           "allreduce of 10 elements of Float (sum)"), std::string::npos) << first[0];
  EXPECT_NE(first[1].find("rank 0's collective is an allreduce of 10 elements of Float (sum) where rank 1's is an "
                           "allreduce of 12 elements of Float (sum)"), std::string::npos) << first[1];
  for (const auto& text : later) {
    EXPECT_NE(text.find("an earlier collective of this group through shared memory failed"), std::string::npos) << text;
  }
}

// Over Gloo's TCP an allreduce and an all-gather never pair; here they meet
// in the same segments, and their headers tell them apart.
TEST(SharedMemoryCollectives, AnAllreduceMeetingAnAllGatherFailsOnEveryRankNamingBoth) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  on_transports(2, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    auto t = torch::ones({8});
    const auto error = testing::error_of([&] {
      if (rank == 0) {
        transport->allreduce(t, ReduceOp::Sum);
      } else {
        transport->all_gather({torch::empty({8}), torch::empty({8})}, t, {});
      }
    });
    std::lock_guard<std::mutex> lock(mutex);
    errors[rank] = error;
  });
  EXPECT_NE(errors[0].find("rank 1's collective is an all-gather of 8 elements of Float where rank 0's is an allreduce"),
            std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0's collective is an allreduce of 8 elements of Float (sum) where rank 1's is an "
                           "all-gather"), std::string::npos) << errors[1];
}

// A planned gather that meets another rank's check, of the same size and
// dtype, must not pair with it (Note [Planned collectives]).
TEST(SharedMemoryCollectives, APlannedCollectiveMeetingAnUnplannedOneFailsOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  on_transports(2, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    auto t = torch::ones({16}, torch::kLong);
    auto words = torch::zeros({2 * 8}, torch::kDouble);
    const auto error = testing::error_of([&] {
      transport->all_gather({torch::empty_like(t), torch::empty_like(t)}, t, rank == 0 ? words : torch::Tensor());
    });
    std::lock_guard<std::mutex> lock(mutex);
    errors[rank] = error;
  });
  EXPECT_NE(errors[0].find("rank 1's collective is an all-gather of 16 elements of Long where rank 0's is an "
                           "all-gather of a plan of 16 elements of Long"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0's collective is an all-gather of a plan of 16 elements of Long where rank 1's is "
                           "an all-gather of 16 elements of Long"), std::string::npos) << errors[1];
}

// This process's segments in /dev/shm.
int segments_left() {
  const std::string mine = "lockstep-" + std::to_string(::getpid()) + "-";
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    count += entry.path().filename().string().rfind(mine, 0) == 0 ? 1 : 0;
  }
  return count;
}

TEST(SharedMemoryCollectives, NoSegmentIsLeftWhenARankNeverComesOrOnceTheGroupIsMade) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::milliseconds(500));
  bool threw = false;
  try { // LibTorch 1.13's HashStore times out with a std::runtime_error, 2.x's with a c10::Error
    SharedMemoryCollectives::connect(*store, 0, 2, std::chrono::seconds(1));
  } catch (const std::exception&) {
    threw = true;
  }
  EXPECT_TRUE(threw) << "connect returned without rank 1";
  EXPECT_EQ(segments_left(), 0) << "rank 0's segment stayed in /dev/shm after rank 1 never came";
  on_transports(2, std::chrono::seconds(10), [&](int, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
  });
  EXPECT_EQ(segments_left(), 0);
}

// A peer that published its segment and then died leaves it in /dev/shm
// unless another rank unlinks it: connect unlinks every published segment
// on the way out, and the join's deadline, which ends the process without
// destructors, unlinks those of a group still joining first.
TEST(SharedMemoryCollectives, ADeadPeersSegmentIsUnlinkedAndTheDeadlineUnlinksWhatIsJoining) {
  const std::string dead = "/lockstep-" + std::to_string(::getpid()) + "-deadpeer";
  const int fd = ::shm_open(dead.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  int own_left_at_deadline = -1;
  auto exchange = [&](const std::string& stage, const std::string& mine) -> std::vector<std::string> {
    if (stage == "segment") {
      return {mine, detail::host_identity() + " " + dead + " 999999"};
    }
    detail::unlink_joining_segments(); // as the deadline would, before std::_Exit
    own_left_at_deadline = segments_left();
    throw std::runtime_error("rank 1 never said whether it mapped the segments");
  };
  EXPECT_THROW(SharedMemoryCollectives::connect(exchange, true, 0, 2, std::chrono::seconds(1)), std::runtime_error);
  EXPECT_EQ(own_left_at_deadline, 0) << "the deadline left the segments in /dev/shm";
  EXPECT_EQ(segments_left(), 0) << "the dead peer's segment stayed in /dev/shm";
  ::shm_unlink(dead.c_str());
}

TEST(SharedMemoryCollectives, BroadcastsInPiecesFromAnyRoot) {
  const int64_t numel = 3000001; // pieces of 5.3 MiB over three ranks
  std::mutex mutex;
  on_transports(3, std::chrono::seconds(30), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    for (int root : {1, 0}) {
      auto t = values_of(rank, numel, torch::kFloat);
      transport->broadcast(t, root);
      std::lock_guard<std::mutex> lock(mutex);
      EXPECT_TRUE(torch::equal(t, values_of(root, numel, torch::kFloat))) << "rank " << rank << ", root " << root;
    }
  });
}

// Chunks larger than a segment's share, over three ranks; a planned
// collective's words reach every rank.
TEST(SharedMemoryCollectives, ReduceScatterAndAllGatherInPiecesWithTheirWords) {
  const int size = 3;
  const int64_t n = 1000003; // 4 MB per chunk: several pieces of 5.3 MiB / 3
  auto input_of = [&](int rank) { return values_of(rank, size * n, torch::kFloat); };
  auto sum = torch::zeros({size * n});
  for (int r = 0; r < size; ++r) {
    sum += input_of(r);
  }
  std::mutex mutex;
  on_transports(size, std::chrono::seconds(30), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    auto words = torch::zeros({size * 8}, torch::kDouble);
    words.narrow(0, rank * 8, 8).fill_(rank + 1);
    auto output = torch::empty({n});
    transport->reduce_scatter(output, input_of(rank), ReduceOp::Sum, words);
    auto gathered_words = torch::zeros({size * 8}, torch::kDouble);
    gathered_words.narrow(0, rank * 8, 8).fill_(10 * (rank + 1));
    std::vector<torch::Tensor> outputs;
    for (int r = 0; r < size; ++r) {
      outputs.push_back(torch::empty({n}));
    }
    transport->all_gather(outputs, output, gathered_words);
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_TRUE(torch::equal(output, sum.narrow(0, rank * n, n))) << "rank " << rank << "'s chunk";
    EXPECT_TRUE(torch::equal(torch::cat(outputs), sum)) << "rank " << rank << "'s gathered chunks";
    for (int r = 0; r < size; ++r) {
      EXPECT_TRUE(torch::equal(words.narrow(0, r * 8, 8), torch::full({8}, double(r + 1), torch::kDouble)))
          << "rank " << rank << " holds rank " << r << "'s words of the reduce-scatter";
      EXPECT_TRUE(torch::equal(gathered_words.narrow(0, r * 8, 8), torch::full({8}, 10.0 * (r + 1), torch::kDouble)))
          << "rank " << rank << " holds rank " << r << "'s words of the all-gather";
    }
  });
}

// A rank adds its own chunk where it lies, and the others' from their
// segments: float sums that depend on their order come out in rank order,
// with the output apart from the input or inside its own chunk.
TEST(SharedMemoryCollectives, AReduceScatterAddsInRankOrderWhereverItsOutputLies) {
  const int size = 3;
  const int64_t n = 700001; // several pieces
  auto input_of = [&](int rank) { // rounded when added, unlike values_of's
    return torch::sin(torch::arange(size * n, torch::kFloat) * (rank + 1.3)) * std::pow(10.0, rank);
  };
  auto sum = input_of(0) + input_of(1);
  sum += input_of(2);
  std::mutex mutex;
  on_transports(size, std::chrono::seconds(30), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    auto apart = torch::empty({n});
    transport->reduce_scatter(apart, input_of(rank), ReduceOp::Sum, torch::Tensor());
    auto input = input_of(rank);
    auto inside = input.narrow(0, rank * n, n);
    transport->reduce_scatter(inside, input, ReduceOp::Sum, torch::Tensor());
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_TRUE(torch::equal(apart, sum.narrow(0, rank * n, n))) << "rank " << rank << ", output apart";
    EXPECT_TRUE(torch::equal(inside, sum.narrow(0, rank * n, n))) << "rank " << rank << ", output in its chunk";
  });
}

// all_gather_into's usual call: the input is this rank's part of the output.
TEST(SharedMemoryCollectives, AnAllGatherWhoseInputIsItsOwnOutputFillsEveryPart) {
  const int size = 3;
  const int64_t n = 1500001; // several pieces
  auto expected = torch::cat({values_of(0, n, torch::kFloat), values_of(1, n, torch::kFloat),
                              values_of(2, n, torch::kFloat)});
  std::mutex mutex;
  on_transports(size, std::chrono::seconds(30), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    auto gathered = torch::full({size * n}, -1.0f);
    gathered.narrow(0, rank * n, n).copy_(values_of(rank, n, torch::kFloat));
    std::vector<torch::Tensor> outputs;
    for (int r = 0; r < size; ++r) {
      outputs.push_back(gathered.narrow(0, r * n, n));
    }
    transport->all_gather(outputs, outputs[rank], torch::Tensor());
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_TRUE(torch::equal(gathered, expected)) << "rank " << rank;
  });
}

TEST(SharedMemoryCollectives, ARankThatNeverArrivesFailsTheOthersAtTheTimeout) {
  std::promise<void> done;
  auto finished = done.get_future().share();
  std::string error;
  double waited = 0;
  on_transports(2, std::chrono::seconds(1), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    if (rank == 1) {
      finished.wait();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    error = testing::error_of([&] { transport->allreduce(torch::ones({4}), ReduceOp::Sum); });
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    done.set_value();
  });
  EXPECT_NE(error.find("rank 1 did not reach this collective within 1000 ms"), std::string::npos) << error;
  EXPECT_GE(waited, 0.9);
  EXPECT_LT(waited, 5.0);
}

TEST(SharedMemoryCollectives, StopEndsAWaitAtOnce) {
  std::promise<void> done;
  auto finished = done.get_future().share();
  std::string error;
  double waited = 0;
  on_transports(2, std::chrono::seconds(60), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    if (rank == 1) {
      finished.wait();
      return;
    }
    std::thread stopper([transport] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      transport->stop();
    });
    const auto start = std::chrono::steady_clock::now();
    error = testing::error_of([&] { transport->allreduce(torch::ones({4}), ReduceOp::Sum); });
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stopper.join();
    done.set_value();
  });
  EXPECT_NE(error.find("the group was destroyed while this collective waited for rank 1"), std::string::npos) << error;
  EXPECT_LT(waited, 5.0);
}

// Note [Buffers every rank can reach]: the ranks' copies of a shared buffer
// are reduced where they lie, to the bits the segments give, over slices and
// chunks of uneven lengths; the memory starts zeroed and outlives the group.
TEST(SharedMemoryCollectives, SharedBuffersAreReducedWhereTheyLieToTheSegmentsBits) {
  for (int size : {2, 3}) {
    const int64_t numel = 1000003;
    std::mutex mutex;
    std::vector<torch::Tensor> kept(size);
    on_transports(size, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
      ASSERT_NE(transport, nullptr);
      const auto buffers = transport->share({64, numel * 4, 24});
      ASSERT_EQ(buffers.size(), 3u);
      auto shared = buffers[1].view(torch::kFloat);
      const bool zeroed = torch::equal(shared, torch::zeros_like(shared));
      // Values whose sum depends on its order, beyond two ranks.
      shared.copy_(torch::arange(numel, torch::kFloat).mul(0.37 * (rank + 1)).sin().mul(1000.0 / (rank + 1)));
      auto plain = shared.clone();
      transport->allreduce(shared, ReduceOp::Sum);
      transport->allreduce(plain, ReduceOp::Sum);
      auto ints = buffers[0].view(torch::kInt).fill_(rank + 1);
      transport->allreduce(ints, ReduceOp::Max);
      std::lock_guard<std::mutex> lock(mutex);
      EXPECT_TRUE(zeroed) << "rank " << rank;
      EXPECT_TRUE(torch::equal(shared, plain)) << "rank " << rank << " of " << size;
      EXPECT_TRUE(torch::equal(ints, torch::full({16}, size, torch::kInt))) << ints;
      kept[rank] = shared;
    });
    const auto sum = kept[0].clone();
    for (int r = 0; r < size; ++r) { // the transports are gone
      EXPECT_TRUE(torch::equal(kept[r], sum)) << "rank " << r;
      kept[r].add_(1);
      EXPECT_TRUE(torch::equal(kept[r], sum + 1)) << "rank " << r;
    }
  }
}

// Sizes that differ, or one that is not positive on one rank only, or none:
// no buffers on any rank, and no rank left waiting in the exchange.
TEST(SharedMemoryCollectives, SharedBuffersOfSizesThatDifferAreNoneOnEveryRankAndTheGroupGoesOn) {
  const std::vector<std::vector<std::vector<int64_t>>> cases = {
      {{64, 128}, {64, 256}}, {{0}, {64}}, {{64}, {-64}}, {{}, {}}, {{}, {64}}};
  for (const auto& sizes : cases) {
    std::mutex mutex;
    std::vector<size_t> made(2, 99);
    std::vector<double> sums(2);
    on_transports(2, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
      ASSERT_NE(transport, nullptr);
      const auto buffers = transport->share(sizes[rank]);
      auto t = torch::ones({4});
      transport->allreduce(t, ReduceOp::Sum);
      std::lock_guard<std::mutex> lock(mutex);
      made[rank] = buffers.size();
      sums[rank] = t.sum().item<double>();
    });
    EXPECT_EQ(made, std::vector<size_t>(2, 0)) << sizes[0].size() << " and " << sizes[1].size() << " sizes";
    EXPECT_EQ(sums, std::vector<double>(2, 8.0));
  }
}

// A rank whose allreduce is of its own memory where the other's is of a
// shared buffer, or of another one, would read and write the wrong bytes.
TEST(SharedMemoryCollectives, AnAllreduceOfASharedBufferMeetingOneOfOtherMemoryFailsOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  on_transports(2, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
    ASSERT_NE(transport, nullptr);
    const auto buffers = transport->share({32});
    ASSERT_EQ(buffers.size(), 1u);
    auto t = rank == 0 ? buffers[0].view(torch::kFloat) : torch::ones({8});
    const auto error = testing::error_of([&] { transport->allreduce(t, ReduceOp::Sum); });
    std::lock_guard<std::mutex> lock(mutex);
    errors[rank] = error;
  });
  EXPECT_NE(errors[0].find("rank 1's collective is an allreduce of 8 elements of Float (sum) where rank 0's is an "
                           "allreduce of 8 elements of Float in shared buffer 0 (sum)"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0's collective is an allreduce of 8 elements of Float in shared buffer 0 (sum) where "
                           "rank 1's is an allreduce of 8 elements of Float (sum)"), std::string::npos) << errors[1];
}

// Note [An average divided where it is summed]: an Avg of float or double,
// in a shared buffer or staged through the segments, is the sum in rank
// order divided by the group's size, the bits of a Sum then Tensor::div_;
// the group asks the backend to average those types only.
TEST(SharedMemoryCollectives, AnAverageIsTheSumDividedOnceWhereverItLies) {
  testing::ScopedEnv shm_on("LOCKSTEP_GLOO_SHM", "1");
  // Values of every size, and, scaled by `tiny`, sums whose averages are
  // subnormal, where a group of two multiplies by 1/2 instead of dividing.
  for (int size : {2, 3}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      for (const double tiny : {1.0, dtype == torch::kFloat ? 1e-41 : 1e-312}) {
        const int64_t numel = 3000001; // pieces of a segment, staged
        std::mutex mutex;
        on_transports(size, std::chrono::seconds(10), [&](int rank, SharedMemoryCollectives* transport) {
          ASSERT_NE(transport, nullptr);
          const auto values =
              torch::arange(numel, dtype).mul(0.37 * (rank + 1)).sin().mul(1000.0 / (rank + 1)).mul(tiny);
          auto summed = values.clone();
          transport->allreduce(summed, ReduceOp::Sum);
          summed.div_(size);
          auto staged = values.clone();
          transport->allreduce(staged, ReduceOp::Avg);
          auto shared = transport->share({numel * static_cast<int64_t>(c10::elementSize(dtype))})[0].view(dtype);
          shared.copy_(values);
          transport->allreduce(shared, ReduceOp::Avg);
          std::lock_guard<std::mutex> lock(mutex);
          EXPECT_TRUE(torch::equal(staged, summed)) << "rank " << rank << " of " << size << ", " << dtype;
          EXPECT_TRUE(torch::equal(shared, summed)) << "rank " << rank << " of " << size << ", " << dtype;
        });
      }
    }
  }
  EXPECT_FALSE(SharedMemoryCollectives::fits(torch::ones({4}, torch::kHalf), ReduceOp::Avg));
  EXPECT_FALSE(SharedMemoryCollectives::fits(torch::ones({4}, torch::kLong), ReduceOp::Avg));
  for (const char* shm : {"1", "0"}) {
    testing::ScopedEnv env("LOCKSTEP_GLOO_SHM", shm);
    testing::spawn(2, [&](ProcessGroup& group) {
      EXPECT_EQ(group.averages_in_backend(torch::kFloat), *shm == '1') << "LOCKSTEP_GLOO_SHM=" << shm;
      EXPECT_FALSE(group.averages_in_backend(torch::kBFloat16));
      auto t = torch::full({5}, static_cast<float>(group.rank()) + 0.5f);
      group.allreduce(t, ReduceOp::Avg);
      EXPECT_TRUE(t.eq(1.0f).all().item<bool>()) << t;
    });
  }
}

} // namespace
} // namespace lockstep
