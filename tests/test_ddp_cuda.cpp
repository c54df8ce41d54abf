// DistributedDataParallel on CUDA tensors: NCCL groups of one, and of two
// ranks as threads on two GPUs. Each reports skipped without its GPUs.

#include <lockstep/lockstep.h>

#include "support/ddp_models.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <tuple>
#include <vector>

namespace lockstep {
namespace {

using testing::OddNet;

// A model and a batch on `device`; the same values for every call with the same seed.
std::tuple<OddNet, torch::Tensor, torch::Tensor> on_device(torch::Device device, int64_t rows, int64_t step) {
  torch::manual_seed(7);
  OddNet net;
  net->to(device);
  auto [x, y] = testing::global_batch(rows, step);
  return {net, x.to(device), y.to(device)};
}

// Three SGD steps of `bare` on (x, y) and of `ddp` on (x2, y2) give the same parameters.
void expect_same_training(OddNet& bare, const torch::Tensor& x, const torch::Tensor& y, DistributedDataParallel<OddNet>& ddp,
                          const torch::Tensor& x2, const torch::Tensor& y2) {
  torch::optim::SGD bare_opt(bare->parameters(), 0.1), ddp_opt(ddp->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    bare_opt.zero_grad();
    ddp_opt.zero_grad();
    torch::mse_loss(bare(x), y).backward();
    torch::mse_loss(ddp(x2), y2).backward();
    bare_opt.step();
    ddp_opt.step();
  }
  auto expected = bare->parameters();
  auto got = ddp->parameters();
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::allclose(expected[i], got[i], 1e-5, 1e-6));
  }
}

TEST(DdpThreads, NcclWorldSizeOneMatchesTheBareModule_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device gpu(torch::kCUDA, 0);
  auto [bare, x, y] = on_device(gpu, 6, 0);
  auto [net, x2, y2] = on_device(gpu, 6, 0);
  // A real NCCL group of one, not the local group that init_process_group gives.
  auto group = new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "nccl");
  EXPECT_EQ(group.backend(), "nccl");
  DistributedDataParallel<OddNet> ddp(net, group);
  expect_same_training(bare, x, y, ddp, x2, y2);
}

TEST(DdpThreads, NcclTwoRanksAverageGradients_MultiCUDA) {
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "fewer than 2 CUDA devices";
  }
  std::vector<std::tuple<OddNet, torch::Tensor, torch::Tensor>> ranks; // made here: the seed is global
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(on_device(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(r)), 6, 0));
  }
  std::vector<torch::Tensor> grads(2);
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        const int r = group.rank();
        const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(r));
        auto t = torch::full({3}, static_cast<float>(r + 1), gpu);
        group.allreduce(t, ReduceOp::Avg);
        EXPECT_TRUE(torch::equal(t.cpu(), torch::full({3}, 1.5f)));
        auto& [net, x, y] = ranks[r];
        DistributedDataParallel<OddNet> ddp(net, group);
        torch::mse_loss(ddp(x.narrow(0, 3 * r, 3)), y.narrow(0, 3 * r, 3)).backward();
        grads[r] = net->parameters()[0].grad().cpu();
      },
      std::chrono::seconds(60), "nccl");
  EXPECT_TRUE(torch::equal(grads[0], grads[1]));
  auto [bare, x, y] = on_device(torch::kCPU, 6, 0);
  torch::mse_loss(bare(x), y).backward();
  EXPECT_TRUE(torch::allclose(bare->parameters()[0].grad(), grads[0], 1e-4, 1e-5));
}

TEST(DdpThreads, NcclGroupOfOneJoinStaticGraphAndRebuildOnCuda_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  // Join's round, the rebuild's broadcast and static_graph's flag all live
  // on the gradients' device: NCCL takes CUDA tensors only.
  const torch::Device gpu(torch::kCUDA, 0);
  auto [bare, x, y] = on_device(gpu, 6, 0);
  auto [net, x2, y2] = on_device(gpu, 6, 0);
  bare->use_branch = false;
  net->use_branch = false;
  auto group = new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "nccl");
  DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().static_graph(true).bucket_cap_mb(1e-4));
  auto join = ddp->join();
  expect_same_training(bare, x, y, ddp, x2, y2);
  join.finish();
  expect_same_training(bare, x, y, ddp, x2, y2); // after join too
}

} // namespace
} // namespace lockstep
