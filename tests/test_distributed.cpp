// Process groups and DistributedDataParallel with ranks as threads in one
// process over an in-memory c10d::HashStore, as Gloo's own tests do. The pure
// parts (bucket assignment, environment parsing) are in test_bucket_assignment.cpp and test_launch_env.cpp.

#include <lockstep/c10d.h>
#include <lockstep/lockstep.h>

#include "../src/util/torch_compat.h"
#include "support/ddp_models.h"
#include "support/errors.h"
#include "support/modules.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

namespace lockstep {
namespace {

using testing::error_of;
using testing::OddNet;

// --- process groups -------------------------------------------------------------

TEST(ProcessGroup, NcclIsAvailableExactlyInCudaBuilds) {
  // LOCKSTEP_TORCH_HAS_CUDA: whether the LibTorch this was built against is a
  // CUDA build (tests/CMakeLists.txt); such a build must compile the NCCL backend.
  auto backends = available_backends();
  const bool nccl = std::find(backends.begin(), backends.end(), "nccl") != backends.end();
  EXPECT_EQ(nccl, LOCKSTEP_TORCH_HAS_CUDA != 0);
  EXPECT_NE(std::find(backends.begin(), backends.end(), "gloo"), backends.end());
}

TEST(ProcessGroup, UnknownBackendListsTheAvailableOnes) {
  auto message = error_of([] { init_process_group(ProcessGroupOptions().rank(0).world_size(1).backend("ucc")); });
  EXPECT_NE(message.find("backend \"ucc\" is not available in this build; available: \"gloo\""), std::string::npos) << message;
}

// Whether something on this machine accepts a TCP connection at host:port.
bool accepts(const char* host, int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host, &address.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return connected;
}

TEST(ProcessGroup, StoreListensOnMasterAddrOnly) {
  const int port = 21000 + static_cast<int>(::getpid() % 20000);
  std::vector<ProcessGroup> groups(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  ::testing::internal::CaptureStderr();
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      errors[r] = error_of([&] {
        groups[r] = init_process_group(
            ProcessGroupOptions().rank(r).world_size(2).master_addr("127.0.0.1").master_port(port).backend("gloo"));
      });
    });
  }
  for (auto& t : ranks) {
    t.join();
  }
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(errors, std::vector<std::string>(2)) << errors[0] << errors[1];
  // Where the store cannot be bound to MASTER_ADDR, rank 0 says so, once.
  EXPECT_EQ(warnings.find("listens on every interface at port " + std::to_string(port)) != std::string::npos,
            !detail::kStoreTakesListenSocket) << warnings;
  EXPECT_TRUE(accepts("127.0.0.1", port));
  // 127.0.0.2 is this machine too, but not MASTER_ADDR: PyTorch 2.x's store
  // listens where we bound it; 1.13's on every interface (Note [Store address]).
  EXPECT_EQ(accepts("127.0.0.2", port), !detail::kStoreTakesListenSocket);
}

TEST(ProcessGroup, UnresolvableMasterAddrFailsAtOnce) {
  const auto start = std::chrono::steady_clock::now();
  auto message = error_of([] {
    init_process_group(ProcessGroupOptions().rank(1).world_size(2).master_addr("no-such-host.invalid").master_port(29999)
                           .timeout(std::chrono::seconds(20)));
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(message.find("rank 1: MASTER_ADDR no-such-host.invalid does not resolve"), std::string::npos) << message;
  EXPECT_LT(seconds, 10.0) << "waited for the store's timeout instead of failing at once";
}

// --- ranks as threads ---------------------------------------------------------------

class Threads : public ::testing::TestWithParam<int> {};

TEST_P(Threads, Collectives) {
  const int size = GetParam();
  testing::spawn(size, [size](ProcessGroup& group) {
    const int r = group.rank();
    // Distinct values per rank, odd element count, and an empty tensor.
    auto t = torch::arange(5, torch::kFloat) + 10 * r;
    group.allreduce(t, ReduceOp::Sum);
    EXPECT_TRUE(torch::equal(t, torch::arange(5, torch::kFloat) * size + 10 * size * (size - 1) / 2));
    auto empty = torch::zeros({0});
    group.allreduce(empty);
    auto b = torch::full({3}, static_cast<float>(r));
    group.broadcast(b, size - 1);
    EXPECT_TRUE(torch::equal(b, torch::full({3}, static_cast<float>(size - 1))));
    auto all = group.all_gather(torch::full({2}, static_cast<float>(r)));
    ASSERT_EQ(static_cast<int>(all.size()), size);
    for (int k = 0; k < size; ++k) {
      EXPECT_TRUE(torch::equal(all[k], torch::full({2}, static_cast<float>(k))));
    }
    group.barrier();
  });
}

// N ranks on B/N rows each reach the same parameters as one process on B
// rows, and all ranks hold bitwise-identical parameters after every step.
void expect_ddp_equivalence(int size, DistributedOptions options, double rtol, double atol) {
  const int64_t per_rank = 3; // odd
  torch::manual_seed(5);
  OddNet reference;
  std::vector<OddNet> models;
  for (int r = 0; r < size; ++r) {
    torch::manual_seed(100 + r); // different initial values: DDP must broadcast rank 0's
    models.emplace_back();
  }
  testing::copy_parameters(*reference, *models[0]);
  const int steps = 4;
  testing::spawn(size, [&](ProcessGroup& group) {
    const int r = group.rank();
    DistributedDataParallel<OddNet> ddp(models[r], group, options);
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = testing::global_batch(per_rank * size, step);
      opt.zero_grad();
      torch::mse_loss(ddp(x.narrow(0, r * per_rank, per_rank)), y.narrow(0, r * per_rank, per_rank)).backward();
      opt.step();
      for (const auto& p : ddp->parameters()) {
        auto all = group.all_gather(p.detach());
        for (int k = 1; k < size; ++k) {
          EXPECT_TRUE(torch::equal(all[0], all[k])) << "rank " << k << " differs at step " << step;
        }
      }
    }
  });
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = testing::global_batch(per_rank * size, step);
    opt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    opt.step();
  }
  testing::expect_params_close(*reference, *models[0], rtol, atol);
}

TEST_P(Threads, DdpMatchesOneProcessOnTheWholeBatch) {
  expect_ddp_equivalence(GetParam(), DistributedOptions(), 1e-5, 1e-6);
}

TEST_P(Threads, DdpWithTinyBucketsAndGradientViews) {
  // 64-byte buckets: every parameter its own bucket, reduced while backward runs.
  expect_ddp_equivalence(GetParam(), DistributedOptions().bucket_cap_mb(64.0 / (1 << 20)).gradient_as_bucket_view(true),
                         1e-5, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Threads, ::testing::Values(1, 2, 3, 4));

TEST(DdpThreads, GradientsAreAveragedBeforeBackwardReturns) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::manual_seed(1);
    OddNet net;
    DistributedDataParallel<OddNet> ddp(net, group);
    auto x = torch::full({2, 7}, static_cast<float>(group.rank() + 1));
    ddp(x).sum().backward();
    // d(sum)/d(scale) is linear in x's rank-dependent values; compare with
    // the average computed by hand from both ranks' local gradients.
    OddNet local = std::dynamic_pointer_cast<testing::OddNetImpl>(net->clone());
    local->zero_grad();
    local(x).sum().backward();
    auto mine = local->fc1->weight.grad();
    auto both = group.all_gather(mine);
    // The local and DDP forwards run on two threads at once; with 2.x's CPU
    // kernels their results differ by up to 4e-5 in about 3% of runs (1.13:
    // never), against about 0.14 between the ranks' own gradients.
    EXPECT_TRUE(torch::allclose(net->fc1->weight.grad(), (both[0] + both[1]) / 2, 1e-4, 1e-4))
        << (net->fc1->weight.grad() - (both[0] + both[1]) / 2).abs().max().item<double>();
  });
}

TEST(DdpThreads, BucketsFollowReverseRegistrationOrder) {
  testing::spawn(1, [](ProcessGroup& group) {
    OddNet net;
    DistributedDataParallel<OddNet> ddp(net, group);
    auto buckets = ddp->buckets();
    ASSERT_EQ(buckets.size(), 1u); // a few hundred bytes: one first bucket
    const size_t n = net->parameters().size();
    ASSERT_EQ(buckets[0].size(), n);
    EXPECT_EQ(buckets[0].front(), n - 1);
    EXPECT_EQ(buckets[0].back(), 0u);
  });
}

TEST(DdpThreads, BucketsAreReducedWhileBackwardRuns) {
  testing::spawn(2, [](ProcessGroup& group) {
    OddNet net;
    size_t launched = 0;
    auto counting = [&launched](const ProcessGroup& g, GradBucket& b) {
      ++launched;
      return comm_hooks::allreduce(g, b);
    };
    // One bucket per parameter.
    DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().bucket_cap_mb(1e-6).comm_hook(counting));
    const size_t buckets = ddp->buckets().size();
    ASSERT_GT(buckets, 3u);
    // The input's gradient is among the last things backward computes: by
    // then the buckets of fc2 and branch (4, reduced first) have gone out.
    // scale's and empty's come after fc1's in bucket order, so they wait.
    auto x = torch::randn({4, 7}, torch::requires_grad());
    size_t launched_before_end = 0;
    x.register_hook([&](torch::Tensor) { launched_before_end = launched; });
    ddp(x).sum().backward();
    EXPECT_GE(launched_before_end, 4u);
    EXPECT_LT(launched_before_end, buckets);
    EXPECT_EQ(launched, buckets);
  });
}

TEST(DdpThreads, UserHookReturningACompletedResult) {
  testing::spawn(3, [](ProcessGroup& group) {
    auto synchronous_mean = [](const ProcessGroup& g, GradBucket& b) {
      auto averaged = b.buffer.clone();
      g.allreduce(averaged, ReduceOp::Avg);
      return comm_hooks::completed(averaged);
    };
    torch::manual_seed(2);
    OddNet net;
    DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(synchronous_mean));
    auto x = torch::full({2, 7}, static_cast<float>(group.rank()));
    ddp(x).sum().backward();
    auto grads = group.all_gather(net->fc2->weight.grad());
    EXPECT_TRUE(torch::equal(grads[0], grads[group.size() - 1]));
    OddNet local = std::dynamic_pointer_cast<testing::OddNetImpl>(net->clone());
    local->zero_grad();
    local(x).sum().backward();
    auto all = group.all_gather(local->fc2->weight.grad());
    EXPECT_TRUE(torch::allclose(net->fc2->weight.grad(), (all[0] + all[1] + all[2]) / 3, 1e-5, 1e-6));
  });
}

// A hook's pending() of a null work was dereferenced at the end of backward.
TEST(CommHooks, PendingRefusesANullWorkOrAnUndefinedResult) {
  EXPECT_ERROR_SAYS(comm_hooks::pending(nullptr, torch::ones({2})), "comm_hooks::pending: the work is null");
  auto group = new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "gloo");
  auto work = group.allreduce_async({torch::ones({2})}, ReduceOp::Sum);
  EXPECT_ERROR_SAYS(comm_hooks::pending(work, torch::Tensor()), "comm_hooks::pending: the result tensor is undefined");
}

// A hook's result must be the bucket's reduced gradients: an undefined
// tensor, or integers a quantising hook forgot to decompress (copied into
// the gradients at face value, 100x off), are errors naming the bucket.
TEST(DdpThreads, AHookResultThatIsNoGradientIsAnErrorNamingTheBucket) {
  testing::spawn(2, [](ProcessGroup& group) {
    auto quantised = [](const ProcessGroup& g, GradBucket& b) {
      auto q = (b.buffer * 100).round().to(torch::kInt8);
      g.allreduce(q, ReduceOp::Sum);
      return comm_hooks::completed(q);
    };
    auto undefined = [](const ProcessGroup& g, GradBucket& b) {
      return comm_hooks::completed(torch::Tensor());
    };
    OddNet net;
    const auto x = torch::randn({2, 7});
    {
      DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(quantised));
      EXPECT_ERROR_SAYS(ddp(x).sum().backward(), "the communication hook returned Char values for bucket 0",
                        "must decompress");
    }
    DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(undefined));
    EXPECT_ERROR_SAYS(ddp(x).sum().backward(), "the communication hook's result for bucket 0 (", "is an undefined tensor");
  });
}

// broadcast_buffers(false) leaves each rank's buffers its own from the
// start, as PyTorch's (_sync_module_states with broadcast_buffers): the
// wrapping copied rank 0's all the same.
TEST(DdpThreads, BuffersFollowRankZeroBeforeEachForward) {
  for (bool broadcast : {true, false}) {
    testing::spawn(2, [broadcast](ProcessGroup& group) {
      torch::nn::Sequential seq(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3));
      auto mean = seq->named_buffers()["1.running_mean"];
      {
        torch::NoGradGuard no_grad;
        mean.fill_(static_cast<float>(-group.rank()));
      }
      DistributedDataParallel<torch::nn::Sequential> ddp(seq, group, DistributedOptions().broadcast_buffers(broadcast));
      EXPECT_EQ(mean[0].item<float>(), broadcast ? 0.0f : static_cast<float>(-group.rank())) << "at wrapping";
      {
        torch::NoGradGuard no_grad;
        mean.fill_(static_cast<float>(group.rank() + 1));
      }
      ddp->eval(); // running stats are read, not updated
      ddp(torch::randn({4, 3}));
      EXPECT_EQ(mean[0].item<float>(), broadcast ? 1.0f : static_cast<float>(group.rank() + 1)) << broadcast;
    });
  }
}

// A target computed under NoGradGuard between a forward and its backward
// (TD learning, self-distillation): the backward still averages, as PyTorch's
// DDP does.
TEST(DdpThreads, ANoGradForwardBeforeTheBackwardLeavesItsReduction) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::manual_seed(2);
    OddNet net;
    DistributedDataParallel<OddNet> ddp(net, group);
    auto x = torch::full({2, 7}, static_cast<float>(group.rank() + 1));
    auto out = ddp(x);
    torch::Tensor target;
    {
      torch::NoGradGuard no_grad;
      target = ddp(x * 2);
    }
    torch::mse_loss(out, target).backward();
    OddNet local = std::dynamic_pointer_cast<testing::OddNetImpl>(net->clone());
    local->zero_grad();
    torch::mse_loss(local(x), target).backward();
    auto all = group.all_gather(local->fc2->weight.grad());
    EXPECT_TRUE(torch::allclose(net->fc2->weight.grad(), (all[0] + all[1]) / 2, 1e-5, 1e-6));
    EXPECT_FALSE(torch::allclose(all[0], all[1])); // so the average differs from each rank's own
  });
}

// A model with buffers (BatchNorm's running statistics, synced before each
// forward) run twice before one backward: a target under no grad, and a
// GAN's two batches summed into one loss. The sync must not look like an
// in-place change of what the first forward saved (Note [Buffers synced
// without a version bump]).
TEST(DdpThreads, TwoForwardsOfAModelWithBuffersBeforeOneBackward) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::manual_seed(2);
    torch::nn::Sequential net(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3));
    DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
    const auto x = torch::arange(12, torch::kFloat).view({4, 3}).sin() * (group.rank() + 1);
    auto out = ddp(x);
    torch::Tensor target;
    {
      torch::NoGradGuard no_grad;
      target = ddp(x * 2);
    }
    EXPECT_NO_THROW(torch::mse_loss(out, target).backward());
    ddp->zero_grad();
    EXPECT_NO_THROW((ddp(x).sum() + ddp(x.cos()).square().sum()).backward());
    EXPECT_TRUE(net[0]->as<torch::nn::Linear>()->weight.grad().defined());
  });
}

// A forward under no_sync between a synced forward and its backward (an
// auxiliary pass) leaves that backward reduced, as PyTorch's: it reduced
// nothing, and each rank kept its own gradient.
TEST(DdpThreads, ANoSyncForwardBeforeTheBackwardLeavesItsReduction) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::manual_seed(2);
    OddNet net;
    DistributedDataParallel<OddNet> ddp(net, group);
    auto x = torch::full({2, 7}, static_cast<float>(group.rank() + 1));
    auto out = ddp(x);
    torch::Tensor aux;
    {
      auto guard = ddp->no_sync();
      aux = ddp(x * 2);
    }
    (out.pow(2).sum() + aux.pow(2).sum()).backward();
    auto all = group.all_gather(net->fc2->weight.grad());
    EXPECT_TRUE(torch::equal(all[0], all[1])) << "the ranks' gradients were not reduced";
    OddNet local = std::dynamic_pointer_cast<testing::OddNetImpl>(net->clone());
    local->zero_grad();
    (local(x).pow(2).sum() + local(x * 2).pow(2).sum()).backward();
    auto own = group.all_gather(local->fc2->weight.grad());
    EXPECT_TRUE(torch::allclose(net->fc2->weight.grad(), (own[0] + own[1]) / 2, 1e-5, 1e-6));
  });
}

// A comm hook that throws ends backward early, before the callback that
// would end the step: the next forward says so instead of averaging nothing.
TEST(DdpThreads, ABackwardStoppedByAnErrorIsAnErrorAtTheNextForward) {
  testing::spawn(2, [](ProcessGroup& group) {
    int calls = 0;
    auto failing_once = [&calls](const ProcessGroup& g, GradBucket& b) {
      TORCH_CHECK(++calls > 1, "the hook fails once");
      return comm_hooks::allreduce(g, b);
    };
    OddNet net;
    DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(failing_once));
    auto x = torch::randn({2, 7});
    EXPECT_ERROR_SAYS(ddp(x).sum().backward(), "the hook fails once");
    EXPECT_ERROR_SAYS(ddp(x), "the last backward stopped with an error before its end",
                      "make a new DistributedDataParallel on every rank");
  });
}

// A sparse gradient (Embedding's sparse(true)) is refused when the model is
// wrapped, naming the layer: at the first backward it left the wrapper
// unusable, and ATen's "not a sparse tensor" internal assert asked the user
// to report a bug to PyTorch.
TEST(DdpThreads, ASparseEmbeddingIsRefusedAtWrappingNamingIt) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)),
                              torch::nn::Linear(3, 1));
    EXPECT_ERROR_SAYS((DistributedDataParallel<torch::nn::Sequential>(net, group)), "'0' is an Embedding with "
                      "sparse(true)", "Construct it with sparse(false)");
  });
}

// A parameter of a dtype the backend cannot sum (complex on Gloo; bfloat16
// on 1.13's Gloo) is refused at wrapping, naming it, not at the first
// backward after earlier buckets went out.
TEST(DdpThreads, AParameterTheBackendCannotSumIsRefusedAtWrapping) {
  testing::spawn(2, [](ProcessGroup& group) {
    auto net = torch::nn::Sequential(torch::nn::Linear(3, 1));
    net->register_parameter("phase", torch::ones({2}, torch::kComplexFloat));
    EXPECT_ERROR_SAYS((DistributedDataParallel<torch::nn::Sequential>(net, group)), "parameter 'phase' is "
                      "ComplexFloat, which the gloo backend cannot sum on cpu", "torch::view_as_real");
  });
}

// Two SyncBatchNorm layers of one width that rank 1 runs in the other order:
// their collectives agree in size, so only the layers' numbers keep the
// ranks from swapping statistics (Note [Collective tags]).
struct SwappedNormsImpl : torch::nn::Module {
  SwappedNormsImpl(bool swapped, const ProcessGroup& group) : swapped_(swapped) {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    first = register_module("first", SyncBatchNorm(torch::nn::BatchNormOptions(4), group));
    second = register_module("second", SyncBatchNorm(torch::nn::BatchNormOptions(4), group));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc(x);
    return swapped_ ? first(second(y)) : second(first(y));
  }
  bool swapped_;
  torch::nn::Linear fc{nullptr};
  SyncBatchNorm first{nullptr};
  SyncBatchNorm second{nullptr};
};
TORCH_MODULE(SwappedNorms);

TEST(DdpThreads, SyncBatchNormsRunInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  for (bool sharded : {false, true}) {
    testing::spawn(2, [sharded](ProcessGroup& group) {
      torch::manual_seed(3);
      SwappedNorms net(group.rank() == 1, group);
      auto forward = [&] {
        if (sharded) {
          FullyShardedDataParallel<SwappedNorms> fsdp(net, group);
          fsdp->forward(torch::randn({6, 4}));
        } else {
          DistributedDataParallel<SwappedNorms> ddp(net, group);
          ddp->forward(torch::randn({6, 4}));
        }
      };
      EXPECT_ERROR_SAYS(forward(), "ranks disagree on this collective", "the same sizes, but another collective",
                        "with SyncBatchNorm, layers run in another order", group.rank() == 0 ? "SyncBatchNorm 'first'" :
                        "SyncBatchNorm 'second'");
    }, std::chrono::seconds(20));
  }
}

TEST(DdpThreads, CompressionHooksRoundToTheirType) {
  testing::spawn(2, [](ProcessGroup& group) {
    // 1 + 2^-12 is exact in float32 but not in float16 (11-bit significand)
    // or bfloat16 (8-bit): the averaged result must show the rounding.
    const float value = 1.0f + 1.0f / 4096;
    for (auto [hook, type] : {std::make_pair(&comm_hooks::fp16_compress, torch::kHalf),
                              std::make_pair(&comm_hooks::bf16_compress, torch::kBFloat16)}) {
      GradBucket bucket{0, torch::full({5}, value), {0}, "bucket 0", {}, true, {}};
      auto averaged = hook(group, bucket)->wait();
      const auto expected = torch::full({5}, value).div(2).to(type).to(torch::kFloat) * 2;
      EXPECT_TRUE(torch::equal(averaged, expected)) << averaged << " vs " << expected;
      EXPECT_NE(averaged[0].item<float>(), value);
      GradBucket exact{0, torch::full({5}, value), {0}, "bucket 0", {}, true, {}};
      EXPECT_EQ(comm_hooks::allreduce(group, exact)->wait()[0].item<float>(), value);
    }
    // A bfloat16 bucket, which 1.13's Gloo cannot sum in its own type: summed in float32 there.
    const auto halves = torch::full({5}, 0.5 + group.rank(), torch::kBFloat16);
    GradBucket narrow{0, halves, {0}, "bucket 0", {}, true, {}};
    const auto averaged = comm_hooks::bf16_compress(group, narrow)->wait();
    EXPECT_EQ(averaged.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(averaged, torch::full({5}, 1.0, torch::kBFloat16))) << averaged;
  });
}

TEST(DdpThreads, WrapsACallersOwnC10dGroup) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::vector<float> results(2);
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto options = c10d::ProcessGroupGloo::Options::create();
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto c10d_group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
      auto group = from_c10d(c10d_group);
      auto t = torch::full({1}, static_cast<float>(rank + 1));
      group.allreduce(t, ReduceOp::Avg);
      results[rank] = t.item<float>();
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(results, (std::vector<float>{1.5f, 1.5f}));
}

} // namespace
} // namespace lockstep
