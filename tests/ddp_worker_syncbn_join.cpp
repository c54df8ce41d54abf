// Scenarios of lockstep_ddp_worker (tests/ddp_worker.cpp runs them):
// SyncBatchNorm on uneven batches against one BatchNorm on the whole batch,
// on the CPU, on CUDA and inside DDP; and join() with uneven inputs,
// against one process trained on every rank's batches.

#include "support/worker.h"

#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace testing {

namespace {

struct SyncBnCase {
  std::vector<int64_t> trailing; // dimensions after (N, C)
  std::vector<int64_t> rows; // per rank, for up to 3 ranks
};

constexpr int64_t kSyncBnChannels = 3;

// One training step of `sync` on this rank's rows of a batch of `shape`
// against `reference` on the whole batch; `offsets`: where each rank's rows
// start.
void check_sync_bn_step(const ProcessGroup& group, lockstep::SyncBatchNorm& sync, torch::nn::AnyModule& reference,
                        const std::vector<int64_t>& shape, const std::vector<int64_t>& offsets, int step,
                        const std::string& what) {
  const int r = group.rank();
  const int64_t mine = offsets[r + 1] - offsets[r];
  torch::manual_seed(40 + step);
  // Far from zero mean: a plain sum of squares would lose the variance.
  auto x = torch::randn(shape) * 2 + 50;
  auto g = torch::randn(shape);
  {
    torch::NoGradGuard no_grad; // different parameters than 1 and 0, the same on every rank
    sync->weight.copy_(torch::linspace(0.5, 1.5, kSyncBnChannels) + step);
    sync->bias.copy_(torch::linspace(-1, 1, kSyncBnChannels));
    reference.ptr()->named_parameters()["weight"].copy_(sync->weight);
    reference.ptr()->named_parameters()["bias"].copy_(sync->bias);
  }
  auto x_all = x.clone().requires_grad_(true);
  auto y_all = reference.forward(x_all);
  (y_all * g).sum().backward();
  auto x_mine = x.narrow(0, offsets[r], mine).clone().requires_grad_(true);
  auto y_mine = sync(x_mine);
  (y_mine * g.narrow(0, offsets[r], mine)).sum().backward();
  check(torch::allclose(y_mine, y_all.narrow(0, offsets[r], mine), 1e-5, 1e-5), "output, " + what, r);
  check(torch::allclose(x_mine.grad(), x_all.grad().narrow(0, offsets[r], mine), 1e-5, 1e-5), "input gradient, " + what, r);
  for (const char* name : {"weight", "bias"}) {
    auto summed = sync->named_parameters()[name].grad().clone();
    group.allreduce(summed);
    const auto expected = reference.ptr()->named_parameters()[name].grad();
    check(torch::allclose(summed, expected, 1e-5, 1e-4), std::string(name) + " gradient summed over ranks, " + what, r);
    sync->named_parameters()[name].mutable_grad().reset();
    reference.ptr()->named_parameters()[name].mutable_grad().reset();
  }
  for (const char* name : {"running_mean", "running_var", "num_batches_tracked"}) {
    check(torch::allclose(sync->named_buffers()[name].to(torch::kDouble),
                          reference.ptr()->named_buffers()[name].to(torch::kDouble), 1e-5, 1e-5),
          std::string(name) + ", " + what, r);
  }
}

// Two steps of one case: its input's trailing dimensions and each rank's rows.
void check_sync_bn_case(const ProcessGroup& group, const SyncBnCase& c) {
  const int r = group.rank();
  std::vector<int64_t> offsets{0};
  for (int k = 0; k < group.size(); ++k) {
    offsets.push_back(offsets.back() + c.rows[k % 3]);
  }
  const int64_t mine = c.rows[r % 3];
  const std::string what = std::to_string(2 + c.trailing.size()) + "-D input, " + std::to_string(mine) + " rows on this rank";
  torch::nn::AnyModule reference;
  if (c.trailing.size() <= 1) {
    reference = torch::nn::AnyModule(torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(kSyncBnChannels).momentum(0.3)));
  } else {
    reference = torch::nn::AnyModule(torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(kSyncBnChannels).momentum(0.3)));
  }
  lockstep::SyncBatchNorm sync(torch::nn::BatchNormOptions(kSyncBnChannels).momentum(0.3), group);
  std::vector<int64_t> shape{offsets.back(), kSyncBnChannels};
  shape.insert(shape.end(), c.trailing.begin(), c.trailing.end());
  for (int step = 0; step < 2; ++step) {
    check_sync_bn_step(group, sync, reference, shape, offsets, step, what);
  }
}

// Eval mode: the running statistics, and no collective.
void check_sync_bn_eval(const ProcessGroup& group) {
  const int r = group.rank();
  auto counting = std::make_shared<CountingGroup>(group);
  lockstep::SyncBatchNorm sync{torch::nn::BatchNormOptions(kSyncBnChannels), ProcessGroup(counting)};
  torch::nn::BatchNorm1d bn(kSyncBnChannels);
  sync->eval();
  bn->eval();
  auto x = torch::randn({4, kSyncBnChannels}) + static_cast<double>(r);
  check(torch::equal(sync(x), bn(x)), "eval mode is BatchNorm's", r);
  check(counting->allreduces == 0, "eval mode communicates nothing: " + std::to_string(counting->allreduces) + " allreduces", r);
}

} // namespace

// SyncBatchNorm on uneven batches (0 included) against one BatchNorm on the
// concatenated batch: output, input gradient, summed parameter gradients and
// running statistics, over two steps, for 2-, 3- and 4-D input.
void sync_batch_norm(const ProcessGroup& group) {
  const std::vector<SyncBnCase> cases = {{{}, {3, 0, 4}}, {{5}, {0, 3, 2}}, {{3, 2}, {2, 5, 0}}};
  for (const auto& c : cases) {
    check_sync_bn_case(group, c);
  }
  check_sync_bn_eval(group);
}

// SyncBatchNorm on CUDA input over the group, against BatchNorm2d on the
// whole batch: Gloo reduces the statistics on the GPU, a backend that cannot
// (MPI) on the CPU. Processes, not threads as ranks: autograd runs the
// backward of every CUDA tensor of a process on one thread per GPU, so two
// thread-ranks on one GPU would wait on each other there. Exits 77 (skipped)
// without a GPU.
void sync_batch_norm_cuda(const ProcessGroup& group) {
  if (!torch::cuda::is_available()) {
    std::exit(77);
  }
  const int r = group.rank();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(3);
  auto x = (torch::randn({7, 4, 3, 3}) * 2 + 30).to(gpu);
  auto g = torch::randn({7, 4, 3, 3}).to(gpu);
  torch::nn::BatchNorm2d bn(4);
  bn->to(gpu);
  auto x_all = x.clone().requires_grad_(true);
  auto y_all = bn(x_all);
  (y_all * g).sum().backward();
  const std::vector<int64_t> offsets{0, 5, 7}; // 5 rows and 2
  lockstep::SyncBatchNorm sync(torch::nn::BatchNormOptions(4), group);
  sync->to(gpu);
  const int64_t rows = offsets[r + 1] - offsets[r];
  auto mine = x.narrow(0, offsets[r], rows).clone().requires_grad_(true);
  auto y = sync(mine);
  (y * g.narrow(0, offsets[r], rows)).sum().backward();
  check(torch::allclose(y, y_all.narrow(0, offsets[r], rows), 1e-5, 1e-5), "output on CUDA", r);
  check(torch::allclose(mine.grad(), x_all.grad().narrow(0, offsets[r], rows), 1e-5, 1e-5), "input gradient on CUDA", r);
  check(torch::allclose(sync->running_var, bn->running_var, 1e-5, 1e-5), "running variance on CUDA", r);
  auto summed = sync->weight.grad().cpu(); // on the CPU, which every backend reduces
  group.allreduce(summed);
  check(torch::allclose(summed, bn->weight.grad().cpu(), 1e-5, 1e-4), "weight gradient summed on CUDA", r);
}

// DDP over a model holding a SyncBatchNorm: the collectives of both meet in
// one backward, in the same order on every rank. Two SGD steps equal one
// process on the concatenated batch, its loss divided by the world size.
void sync_batch_norm_ddp(const ProcessGroup& group) {
  const int r = group.rank();
  const int world = group.size();
  torch::manual_seed(5);
  torch::nn::Sequential bare(torch::nn::Linear(7, 6), torch::nn::BatchNorm1d(6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
  torch::nn::Sequential net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(bare->clone());
  check(lockstep::convert_sync_batchnorm(net, group) == 1, "one BatchNorm converted", r);
  DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
  torch::optim::SGD opt(ddp->parameters(), 0.1);
  torch::optim::SGD ref_opt(bare->parameters(), 0.1);
  const std::vector<int64_t> rows{3, 1, 4};
  for (int step = 0; step < 2; ++step) {
    int64_t total = 0, offset = 0;
    for (int k = 0; k < world; ++k) {
      offset += k < r ? rows[k] : 0;
      total += rows[k];
    }
    auto [x, y] = lockstep::testing::global_batch(total, step);
    opt.zero_grad();
    // DDP averages: (1/world) * the sum of every rank's loss, as the reference.
    torch::mse_loss(ddp->forward(x.narrow(0, offset, rows[r])), y.narrow(0, offset, rows[r]), torch::Reduction::Sum).backward();
    opt.step();
    ref_opt.zero_grad();
    (torch::mse_loss(bare->forward(x), y, torch::Reduction::Sum) / world).backward();
    ref_opt.step();
  }
  check_close(*bare, *net, 1e-5, 1e-5, r, "DDP with SyncBatchNorm after 2 steps");
  check_identical_across_ranks(group, *net);
}

// A small model with a buffer (BatchNorm's running statistics).
struct JoinNetImpl : torch::nn::Cloneable<JoinNetImpl> {
  JoinNetImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(7, 9));
    bn = register_module("bn", torch::nn::BatchNorm1d(9));
    fc2 = register_module("fc2", torch::nn::Linear(9, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::tanh(bn(fc1(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(JoinNet);

std::pair<torch::Tensor, torch::Tensor> join_batch(int rank, int index) {
  auto [x, y] = lockstep::testing::global_batch(kPerRank * 8, index);
  return {x.narrow(0, rank * kPerRank, kPerRank), y.narrow(0, rank * kPerRank, kPerRank)};
}

// What join must equal, in one process: at each iteration, the sum of the
// gradients of the ranks that still have a batch (of `counts`), divided by
// the world size or by their number.
void join_reference_steps(JoinNet& reference, torch::optim::SGD& ref_opt, const std::vector<int>& counts,
                          bool divide_by_initial_world_size) {
  const int world = static_cast<int>(counts.size());
  const int iterations = *std::max_element(counts.begin(), counts.end());
  for (int b = 0; b < iterations; ++b) {
    std::vector<int> training;
    for (int k = 0; k < world; ++k) {
      if (counts[k] > b) {
        training.push_back(k);
      }
    }
    const double divisor = divide_by_initial_world_size ? world : static_cast<double>(training.size());
    ref_opt.zero_grad();
    for (int k : training) {
      auto [x, y] = join_batch(k, b);
      (torch::mse_loss(reference(x), y) / divisor).backward();
    }
    ref_opt.step();
  }
}

void check_buffers_identical_across_ranks(const ProcessGroup& group, torch::nn::Module& net) {
  for (const auto& b : net.named_buffers()) {
    auto all = group.all_gather(b.value());
    for (size_t k = 1; k < all.size(); ++k) {
      check(torch::equal(all[0], all[k]), "buffer '" + b.key() + "' bitwise equal on rank " + std::to_string(k), group.rank());
    }
  }
}

// Out of join, nothing changes: one more step on every rank, with no join
// round. A fresh optimizer: the ranks that joined early skipped steps, so
// their momentum differs (JoinGuard's documentation says so).
void check_step_out_of_join(const ProcessGroup& group, DistributedDataParallel<JoinNet>& ddp, CountingGroup& counting) {
  torch::optim::SGD after(ddp->parameters(), 0.1);
  auto [x, y] = join_batch(group.rank(), 0);
  after.zero_grad();
  const int before = counting.allreduces;
  torch::mse_loss(ddp(x), y).backward();
  after.step();
  check(counting.allreduces - before == static_cast<int>(ddp->buckets().size()), "no round out of join", group.rank());
}

// Ranks given `counts` batches train under join; the result must equal the
// same schedule computed by hand in one process: at each iteration, the sum
// of the gradients of the ranks that still have a batch, divided by the world
// size or by their number.
void join(const ProcessGroup& group, std::vector<int> counts, bool divide_by_initial_world_size) {
  const int r = group.rank();
  const int world = group.size();
  counts.resize(world);
  torch::manual_seed(11 + r); // DDP must broadcast rank 0's
  JoinNet net;
  auto counting = std::make_shared<CountingGroup>(group);
  DistributedDataParallel<JoinNet> ddp(net, ProcessGroup(counting), DistributedOptions().bucket_cap_mb(1e-4));
  JoinNet reference(std::dynamic_pointer_cast<JoinNetImpl>(net->clone()));
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  {
    auto guard = ddp->join(lockstep::JoinOptions().divide_by_initial_world_size(divide_by_initial_world_size));
    for (int b = 0; b < counts[r]; ++b) {
      auto [x, y] = join_batch(r, b);
      const int before = counting->allreduces;
      opt.zero_grad();
      torch::mse_loss(ddp(x), y).backward();
      opt.step();
      // Each bucket (plain mode's check rides in the last: Note [Static
      // graph]), and join's round: one extra collective.
      const int expected = static_cast<int>(ddp->buckets().size()) + 1;
      check(counting->allreduces - before == expected, "allreduces in step " + std::to_string(b) + ": " +
            std::to_string(counting->allreduces - before) + ", expected " + std::to_string(expected), r);
    }
    guard.finish();
  }
  join_reference_steps(reference, ref_opt, counts, divide_by_initial_world_size);
  check_close(*reference, *net, 1e-5, 1e-6, r, "after join");
  check_identical_across_ranks(group, *net, " after join");
  check_buffers_identical_across_ranks(group, *net);
  check_step_out_of_join(group, ddp, *counting);
  check_identical_across_ranks(group, *net, " after a step out of join");
}

void join_throw(const ProcessGroup& group, std::vector<int> counts) {
  const int r = group.rank();
  counts.resize(group.size());
  JoinNet net;
  DistributedDataParallel<JoinNet> ddp(net, group);
  torch::optim::SGD opt(ddp->parameters(), 0.1);
  const int shortest = *std::min_element(counts.begin(), counts.end());
  expect_error(group, [&] {
    auto guard = ddp->join(lockstep::JoinOptions().throw_on_early_termination(true));
    for (int b = 0; b < counts[r]; ++b) {
      auto [x, y] = join_batch(r, b);
      opt.zero_grad();
      torch::mse_loss(ddp(x), y).backward();
      opt.step();
    }
    guard.finish();
  }, {"throw_on_early_termination(true)", counts[r] == shortest ? "this rank ran out of inputs" : "still have inputs"});
}

} // namespace testing
} // namespace lockstep
