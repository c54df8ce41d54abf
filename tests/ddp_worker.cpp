// One rank of a multi-process DDP test. Reads torchrun's environment (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or mpirun's with
// LOCKSTEP_TEST_BACKEND=mpi, and runs one scenario:
//
//   lockstep_ddp_worker SCENARIO
//
// Prints "rank R: OK" and exits 0 when every check passed, "rank R: ERROR:
// <message>" and exits 3 on a lockstep error, exits 1 on a failed check.

#include <lockstep/lockstep.h>

#include "support/ddp_models.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

using lockstep::DistributedDataParallel;
using lockstep::DistributedOptions;
using lockstep::ProcessGroup;
using lockstep::testing::OddNet;
using lockstep::testing::OddNetImpl;

constexpr int64_t kPerRank = 4;

int failures = 0;

void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::printf("rank %d: CHECK FAILED: %s\n", rank, what.c_str());
    ++failures;
  }
}

OddNet copy_of(const OddNet& net) {
  return OddNet(std::dynamic_pointer_cast<OddNetImpl>(net->clone()));
}

void check_identical_across_ranks(const ProcessGroup& group, torch::nn::Module& module) {
  for (const auto& p : module.named_parameters()) {
    auto all = group.all_gather(p.value().detach());
    for (size_t k = 1; k < all.size(); ++k) {
      check(torch::equal(all[0], all[k]), "'" + p.key() + "' bitwise equal on rank " + std::to_string(k), group.rank());
    }
  }
}

void check_close(torch::nn::Module& expected, torch::nn::Module& got, double rtol, double atol, int rank, const std::string& what) {
  auto e = expected.named_parameters();
  auto g = got.named_parameters();
  for (size_t i = 0; i < e.size(); ++i) {
    const bool ok = torch::allclose(e[i].value(), g[i].value(), rtol, atol);
    check(ok, what + " '" + e[i].key() + "' max diff " + (ok ? "" : std::to_string((e[i].value() - g[i].value()).abs().max().item<double>())), rank);
  }
}

// Trains `steps` SGD steps through DDP on this rank's rows, and a bare copy on
// the whole batch; the two must agree.
void train_and_compare(const ProcessGroup& group, DistributedOptions options, double rtol, double atol) {
  const int r = group.rank();
  const int world = group.size();
  torch::manual_seed(100 + r); // different initial values: DDP must broadcast rank 0's
  OddNet net;
  DistributedDataParallel<OddNet> ddp(net, group, options);
  OddNet reference = copy_of(net);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = lockstep::testing::global_batch(kPerRank * world, step);
    opt.zero_grad();
    torch::mse_loss(ddp(x.narrow(0, r * kPerRank, kPerRank)), y.narrow(0, r * kPerRank, kPerRank)).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    ref_opt.step();
    check_identical_across_ranks(group, *net);
  }
  check_close(*reference, *net, rtol, atol, r, "after 5 steps");
}

void no_sync(const ProcessGroup& group) {
  const int r = group.rank();
  const int world = group.size();
  torch::manual_seed(7);
  OddNet net;
  int launches = 0;
  auto counting = [&launches](const ProcessGroup& g, lockstep::GradBucket& b) {
    ++launches;
    return lockstep::comm_hooks::allreduce(g, b);
  };
  DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(counting));
  OddNet reference = copy_of(net);
  auto [x, y] = lockstep::testing::global_batch(2 * kPerRank * world, 0);
  auto micro = [&](int m, int rank) {
    const int64_t start = (m * world + rank) * kPerRank;
    return std::make_pair(x.narrow(0, start, kPerRank), y.narrow(0, start, kPerRank));
  };
  {
    auto guard = ddp->no_sync();
    auto [xm, ym] = micro(0, r);
    torch::mse_loss(ddp(xm), ym).backward();
  }
  check(launches == 0, "no bucket reduced inside no_sync, got " + std::to_string(launches), r);
  auto [xm, ym] = micro(1, r);
  torch::mse_loss(ddp(xm), ym).backward();
  check(launches > 0, "buckets reduced after no_sync", r);
  // Reference: the average over ranks of each rank's accumulated gradient.
  for (int m = 0; m < 2; ++m) {
    for (int rank = 0; rank < world; ++rank) {
      auto [xr, yr] = micro(m, rank);
      (torch::mse_loss(reference(xr), yr) / world).backward();
    }
  }
  auto e = reference->named_parameters();
  auto g = net->named_parameters();
  for (size_t i = 0; i < e.size(); ++i) {
    check(torch::allclose(e[i].value().grad(), g[i].value().grad(), 1e-5, 1e-6), "accumulated gradient of '" + e[i].key() + "'", r);
  }
}

void unused(const ProcessGroup& group, bool allowed) {
  const int r = group.rank();
  torch::manual_seed(3);
  OddNet net(13, /*use_branch=*/r == 0); // rank 1 skips the branch
  DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().find_unused_parameters(allowed));
  OddNet local = copy_of(net);
  auto [x, y] = lockstep::testing::global_batch(kPerRank, 0);
  torch::mse_loss(ddp(x), y).backward();
  // Only reached with the option: rank 0's branch gradient, halved.
  torch::mse_loss(local(x), y).backward();
  auto branch = group.all_gather(r == 0 ? local->branch->weight.grad() : torch::zeros_like(local->branch->weight));
  check(torch::allclose(net->branch->weight.grad(), (branch[0] + branch[1]) / 2, 1e-5, 1e-6), "branch gradient averaged with zeros", r);
}

void mismatch(const ProcessGroup& group) {
  OddNet net(group.rank() == 1 ? 12 : 13);
  DistributedDataParallel<OddNet> ddp(net, group);
}

// Every collective and reduction on distinct per-rank values, for any world size.
void collectives(const ProcessGroup& group) {
  const int r = group.rank();
  const int n = group.size();
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kLong}) {
    const auto mine = (torch::arange(5) + 10 * r).to(dtype);
    auto sum = mine.clone(), avg = mine.to(torch::kDouble), max = mine.clone(), min = mine.clone();
    group.allreduce(sum, lockstep::ReduceOp::Sum);
    group.allreduce(avg, lockstep::ReduceOp::Avg);
    group.allreduce(max, lockstep::ReduceOp::Max);
    group.allreduce(min, lockstep::ReduceOp::Min);
    const auto base = torch::arange(5).to(dtype);
    const std::string type = c10::toString(dtype);
    check(torch::equal(sum, base * n + 10 * n * (n - 1) / 2), "sum of " + type, r);
    check(torch::allclose(avg, base.to(torch::kDouble) + 5.0 * (n - 1)), "avg of " + type, r);
    check(torch::equal(max, base + 10 * (n - 1)), "max of " + type, r);
    check(torch::equal(min, base), "min of " + type, r);
  }
  auto b = torch::full({3}, static_cast<float>(r));
  group.broadcast(b, n - 1);
  check(torch::equal(b, torch::full({3}, static_cast<float>(n - 1))), "broadcast from the last rank", r);
  auto all = group.all_gather(torch::full({2, 2}, static_cast<float>(r)));
  check(static_cast<int>(all.size()) == n, "all_gather gives one tensor per rank", r);
  for (int k = 0; k < n && k < static_cast<int>(all.size()); ++k) {
    check(torch::equal(all[k], torch::full({2, 2}, static_cast<float>(k))), "all_gather slot " + std::to_string(k), r);
  }
  group.barrier();
}

// Rank 1 leaves at once; the others' next collective must end in an error.
void early_exit(const ProcessGroup& group) {
  if (group.rank() == 1) {
    std::fflush(stdout);
    std::_Exit(3);
  }
  auto t = torch::ones({4});
  group.allreduce(t);
}

void stall(const ProcessGroup& group) {
  OddNet net;
  DistributedDataParallel<OddNet> ddp(net, group);
  if (group.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(8)); // stops participating
    return;
  }
  auto [x, y] = lockstep::testing::global_batch(kPerRank, 0);
  torch::mse_loss(ddp(x), y).backward();
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) { // a third argument only tags the processes for the test's pgrep
    std::fprintf(stderr, "usage: %s equivalence|views|no_sync|unused|unused_allowed|mismatch|stall|fp16|bf16|collectives|early_exit [TAG]\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  int rank = -1;
  try {
    // gloo under lockstep-run's variables; LOCKSTEP_TEST_BACKEND=mpi under mpirun.
    const char* backend = std::getenv("LOCKSTEP_TEST_BACKEND");
    auto options = lockstep::ProcessGroupOptions().backend(backend != nullptr ? backend : "gloo");
    if (scenario == "stall" || scenario == "early_exit") {
      options.timeout(std::chrono::seconds(3));
    }
    auto group = lockstep::init_process_group(options);
    rank = group.rank();
    if (scenario == "equivalence") {
      train_and_compare(group, DistributedOptions(), 1e-5, 1e-6);
    } else if (scenario == "views") {
      train_and_compare(group, DistributedOptions().gradient_as_bucket_view(true).bucket_cap_mb(1e-4), 1e-5, 1e-6);
    } else if (scenario == "fp16") {
      train_and_compare(group, DistributedOptions().comm_hook(lockstep::comm_hooks::fp16_compress), 1e-2, 1e-3);
    } else if (scenario == "bf16") {
      train_and_compare(group, DistributedOptions().comm_hook(lockstep::comm_hooks::bf16_compress), 5e-2, 1e-2);
    } else if (scenario == "no_sync") {
      no_sync(group);
    } else if (scenario == "unused") {
      unused(group, false);
    } else if (scenario == "unused_allowed") {
      unused(group, true);
    } else if (scenario == "mismatch") {
      mismatch(group);
    } else if (scenario == "stall") {
      stall(group);
    } else if (scenario == "collectives") {
      collectives(group);
    } else if (scenario == "early_exit") {
      early_exit(group);
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
      return 2;
    }
  } catch (const c10::Error& e) {
    std::printf("rank %d: ERROR: %s\n", rank, e.what_without_backtrace());
    std::fflush(stdout);
    return 3;
  }
  if (failures == 0) {
    std::printf("rank %d: OK\n", rank);
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
