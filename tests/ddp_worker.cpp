// One rank of a multi-process DDP test (support/run_worker.h reads the
// environment, makes the group and reports):
//
//   lockstep_ddp_worker SCENARIO [TAG]
//
// A TAG only marks the processes for a test's pgrep.

#include <lockstep/lockstep.h>

#include "support/ddp_models.h"
#include "support/deterministic_checks.h"
#include "support/powersgd_checks.h"
#include "support/run_worker.h"
#include "support/worker.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

namespace {

using lockstep::DistributedDataParallel;
using lockstep::DistributedOptions;
using lockstep::ProcessGroup;
using lockstep::testing::OddNet;
using lockstep::testing::OddNetImpl;

using lockstep::testing::kPerRank;

using lockstep::testing::check;

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

// Both ranks take steps until the buckets are rebuilt and planned; rank 1
// then exits, and rank 0's next backward sends its first bucket, planned,
// through shared memory (Note [Collectives through shared memory]) to a rank
// that is gone.
void peer_exits(const ProcessGroup& group) {
  OddNet net;
  DistributedDataParallel<OddNet> ddp(net, group);
  auto [x, y] = lockstep::testing::global_batch(kPerRank, 0);
  for (int step = 0; step < 3; ++step) {
    torch::mse_loss(ddp(x), y).backward();
  }
  if (group.rank() == 1) {
    std::fflush(stdout);
    std::_Exit(0);
  }
  torch::mse_loss(ddp(x), y).backward();
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


using lockstep::testing::expect_error;
using lockstep::testing::check_close;
using lockstep::testing::check_identical_across_ranks;
using lockstep::testing::copy_of;
using lockstep::testing::CountingGroup;
using lockstep::testing::join;
using lockstep::testing::join_throw;
using lockstep::testing::sync_batch_norm;
using lockstep::testing::sync_batch_norm_cuda;
using lockstep::testing::sync_batch_norm_ddp;

// Layers registered in the reverse of the order forward uses them: backward
// makes l3's gradients first, and registration order puts l1's first.
struct ReversedNetImpl : torch::nn::Cloneable<ReversedNetImpl> {
  ReversedNetImpl() {
    reset();
  }
  void reset() override {
    l3 = register_module("l3", torch::nn::Linear(16, 3));
    l2 = register_module("l2", torch::nn::Linear(16, 16));
    l1 = register_module("l1", torch::nn::Linear(7, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return l3(torch::tanh(l2(torch::tanh(l1(x)))));
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(ReversedNet);

// The names of the parameters in bucket 0, each followed by a space.
std::string first_bucket_names(DistributedDataParallel<ReversedNet>& ddp, const std::vector<std::string>& names) {
  std::string text;
  const auto buckets = ddp->buckets();
  for (size_t i : buckets.front()) {
    text += names[i] + " ";
  }
  return text;
}

void check_same_buckets_across_ranks(const ProcessGroup& group, DistributedDataParallel<ReversedNet>& ddp) {
  std::vector<int64_t> flat;
  for (const auto& bucket : ddp->buckets()) {
    flat.push_back(-1);
    flat.insert(flat.end(), bucket.begin(), bucket.end());
  }
  auto layouts = group.all_gather(torch::tensor(flat));
  for (size_t k = 1; k < layouts.size(); ++k) {
    check(torch::equal(layouts[0], layouts[k]), "rank " + std::to_string(k) + " has rank 0's buckets", group.rank());
  }
}

// Rows of micro-batch `micro` for `rank`, out of a batch of three
// micro-batches per rank.
using MicroRows = std::function<std::pair<torch::Tensor, torch::Tensor>(int micro, int rank)>;

// What rebuild's two DDP steps must equal: step 1 on micro-batch 0; step 2
// on micro-batches 1 and 2, averaged over ranks.
void rebuild_reference_steps(ReversedNet& reference, torch::optim::SGD& ref_opt, const MicroRows& rows, int world) {
  for (int micro = 0; micro < 3; ++micro) {
    if (micro != 2) {
      ref_opt.zero_grad();
    }
    for (int k = 0; k < world; ++k) {
      auto [xr, yr] = rows(micro, k);
      (torch::mse_loss(reference(xr), yr) / world).backward();
    }
    if (micro != 1) {
      ref_opt.step();
    }
  }
}

// The first step's gradient order rebuilds the buckets at the second
// reducing forward, the same on every rank; a no_sync step in between
// carries its accumulated gradients into the new buckets.
void rebuild(const ProcessGroup& group, bool views) {
  const int r = group.rank();
  const int world = group.size();
  torch::manual_seed(21);
  ReversedNet net;
  // One bucket per parameter or so: the order is then visible.
  DistributedDataParallel<ReversedNet> ddp(net, group, DistributedOptions().bucket_bytes(256).first_bucket_bytes(64).gradient_as_bucket_view(views));
  ReversedNet reference(std::dynamic_pointer_cast<ReversedNetImpl>(net->clone()));
  torch::optim::SGD opt(ddp->parameters(), 0.1);
  torch::optim::SGD ref_opt(reference->parameters(), 0.1);
  const auto names = net->named_parameters().keys();
  check(first_bucket_names(ddp, names).find("l1.") != std::string::npos,
        "before the rebuild, bucket 0 follows registration: " + first_bucket_names(ddp, names), r);
  auto [x, y] = lockstep::testing::global_batch(kPerRank * world * 3, 0);
  const MicroRows rows = [&x = x, &y = y, world](int micro, int rank) {
    const int64_t start = (micro * world + rank) * kPerRank;
    return std::make_pair(x.narrow(0, start, kPerRank), y.narrow(0, start, kPerRank));
  };
  // Step 1: reduced; records the order.
  opt.zero_grad();
  auto [x0, y0] = rows(0, r);
  torch::mse_loss(ddp(x0), y0).backward();
  opt.step();
  // Step 2: micro-batch 1 under no_sync, micro-batch 2 reduced (the rebuild happens at its forward).
  opt.zero_grad();
  {
    auto guard = ddp->no_sync();
    auto [x1, y1] = rows(1, r);
    torch::mse_loss(ddp(x1), y1).backward();
  }
  auto [x2, y2] = rows(2, r);
  torch::mse_loss(ddp(x2), y2).backward();
  opt.step();
  const auto after = first_bucket_names(ddp, names);
  check(after.find("l3.") != std::string::npos && after.find("l1.") == std::string::npos,
        "after the rebuild, bucket 0 holds l3, whose gradients come first: " + after, r);
  check_same_buckets_across_ranks(group, ddp);
  rebuild_reference_steps(reference, ref_opt, rows, world);
  check_close(*reference, *net, 1e-5, 1e-6, r, "after the rebuild");
  check_identical_across_ranks(group, *net);
}

// static_graph on a model that never uses its branch: equal to one process,
// and after the first step one allreduce per bucket, nothing more.
void static_graph(const ProcessGroup& group) {
  const int r = group.rank();
  const int world = group.size();
  auto counting = std::make_shared<CountingGroup>(group);
  torch::manual_seed(100 + r);
  OddNet net(13, /*use_branch=*/false);
  DistributedDataParallel<OddNet> ddp(net, ProcessGroup(counting), DistributedOptions().static_graph(true).bucket_cap_mb(1e-4));
  OddNet reference = copy_of(net);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = lockstep::testing::global_batch(kPerRank * world, step);
    const int before = counting->allreduces;
    opt.zero_grad();
    torch::mse_loss(ddp(x.narrow(0, r * kPerRank, kPerRank)), y.narrow(0, r * kPerRank, kPerRank)).backward();
    opt.step();
    if (step >= 1) {
      check(counting->allreduces - before == static_cast<int>(ddp->buckets().size()),
            "one allreduce per bucket and nothing more at step " + std::to_string(step) + ": " +
                std::to_string(counting->allreduces - before) + " for " + std::to_string(ddp->buckets().size()) + " buckets",
            r);
    }
    ref_opt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    ref_opt.step();
  }
  check_close(*reference, *net, 1e-5, 1e-6, r, "static_graph after 5 steps");
  check_identical_across_ranks(group, *net);
}

// static_graph, then rank 1 changes which parameters it uses at step 2:
// every rank throws, naming rank 1 and the branch.
void static_graph_broken(const ProcessGroup& group, bool starts_with_branch) {
  const int r = group.rank();
  OddNet net(13, starts_with_branch);
  DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().static_graph(true));
  auto [x, y] = lockstep::testing::global_batch(kPerRank, 0);
  for (int step = 0; step < 2; ++step) {
    torch::mse_loss(ddp(x), y).backward();
  }
  if (r == 1) {
    net->use_branch = !starts_with_branch;
  }
  expect_error(group, [&] { torch::mse_loss(ddp(x), y).backward(); },
               {"static_graph(true)", "rank 1's 'branch.weight' received ",
                starts_with_branch ? "no gradient, but got one in the first iteration" : "a gradient, but got none in the first iteration"});
}

// Two DDP steps, then rank 1 skips a collective the others run, and every
// rank ends in a barrier: the ranks disagree from that collective on, every
// rank fails within the timeout, and each writes its flight record.
void desync_skip(const ProcessGroup& group) {
  OddNet net;
  DistributedDataParallel<OddNet> ddp(net, group);
  auto [x, y] = lockstep::testing::global_batch(kPerRank, 0);
  for (int step = 0; step < 2; ++step) {
    torch::mse_loss(ddp(x), y).backward();
  }
  auto t = torch::ones({4});
  if (group.rank() != 1) {
    group.allreduce(t);
  }
  group.barrier();
}

// Three DDP steps with many buckets, for the timeline (LOCKSTEP_TIMELINE):
// prints how many buckets there are.
void timeline_steps(const ProcessGroup& group) {
  OddNet net;
  DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().bucket_cap_mb(1e-4));
  auto [x, y] = lockstep::testing::global_batch(kPerRank, 0);
  for (int step = 0; step < 3; ++step) {
    torch::mse_loss(ddp(x), y).backward();
  }
  std::printf("rank %d: buckets: %zu\n", group.rank(), ddp->buckets().size());
}

// The "tcp_store" scenario's group: lockstep::new_group over a TCPStore this
// program makes at MASTER_ADDR:MASTER_PORT (rank 0 serves it), as a program
// that manages its own store does; under a PrefixStore with
// LOCKSTEP_TEST_STORE_PREFIX.
std::string env(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr, name, " is not set");
  return std::string(value);
}

ProcessGroup group_over_own_tcp_store() {
  const int rank = std::stoi(env("RANK"));
  const int size = std::stoi(env("WORLD_SIZE"));
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(std::stoi(env("MASTER_PORT")));
  options.isServer = rank == 0;
  options.numWorkers = size;
  options.timeout = std::chrono::seconds(20);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(env("MASTER_ADDR"), options);
  if (const char* prefix = std::getenv("LOCKSTEP_TEST_STORE_PREFIX")) { // a program's own PrefixStore
    store = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  }
  return lockstep::new_group(store, rank, size, "gloo", std::chrono::seconds(10));
}

// Spans on 1100 threads one after another, as a program making a
// DataParallel per evaluation makes threads: the threads' tracks must not
// run into the named tracks' numbers.
void spans_on_many_threads(const ProcessGroup&) {
  for (int i = 0; i < 1100; ++i) {
    std::thread([] { lockstep::timeline::Span span("work"); }).join();
  }
  lockstep::timeline::Span span("allreduce", -1, "collectives");
}

// The "given_ranks" scenario's group: ranks given by ProcessGroupOptions, in
// processes started without a launcher's variables (LOCKSTEP_TEST_RANK and
// LOCKSTEP_TEST_PORT are the test's own).
ProcessGroup group_of_given_ranks() {
  return lockstep::init_process_group(lockstep::ProcessGroupOptions()
                                          .rank(std::stoi(env("LOCKSTEP_TEST_RANK")))
                                          .world_size(2)
                                          .master_addr("127.0.0.1")
                                          .master_port(std::stoi(env("LOCKSTEP_TEST_PORT")))
                                          .backend("gloo"));
}

// The "new_group_late" scenario, under mpirun: rank 1 makes its group long
// after the others' timeout (mpirun ends it once rank 0 fails). Over MPI the
// others wait in MPI's start-up exchange or MPI_Comm_dup, neither with a
// timeout of its own, so new_group's deadline must end them.
ProcessGroup group_joined_late(const char* backend) {
  const int rank = std::stoi(env("OMPI_COMM_WORLD_RANK"));
  const int size = std::stoi(env("OMPI_COMM_WORLD_SIZE"));
  if (rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(30));
  }
  return lockstep::new_group(c10::make_intrusive<c10d::HashStore>(), rank, size, backend, std::chrono::seconds(3));
}

// Scenarios whose group waits for a rank that never comes: a short timeout.
constexpr std::chrono::seconds kShortTimeout{3};

// The "late_join" scenario's group: rank 1 starts joining long after the
// others' timeout.
ProcessGroup group_joined_late_over_gloo() {
  if (std::stoi(env("RANK")) == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(8));
  }
  return lockstep::init_process_group(lockstep::ProcessGroupOptions().backend("gloo").timeout(kShortTimeout));
}

// Runs `scenario` on the group alone.
lockstep::testing::WorkerScenario on_group(std::function<void(const ProcessGroup&)> scenario) {
  return {[scenario](lockstep::testing::WorkerContext& context) { scenario(context.group); }};
}

lockstep::testing::WorkerScenario timing_out(std::function<void(const ProcessGroup&)> scenario) {
  auto entry = on_group(std::move(scenario));
  entry.timeout = kShortTimeout;
  return entry;
}

// support/powersgd_checks.h
void powersgd(lockstep::testing::WorkerContext& context) {
  lockstep::testing::check_powersgd_averages_exactly_at_the_rank(context.group, context.check);
  lockstep::testing::check_powersgd_ranks_agree(context.group, false, context.check);
  lockstep::testing::check_powersgd_ranks_agree(context.group, true, context.check);
  lockstep::testing::check_powersgd_recovers_from_zero_and_inf(context.group, context.check);
}

// support/deterministic_checks.h, with dropout: each micro-batch draws the
// same numbers on whichever rank runs it (and with BatchNorm under Adam),
// under DDP and each FSDP strategy, against DDP on one rank.
void deterministic(const ProcessGroup& group) {
  lockstep::testing::DeterministicRun run;
  run.dropout = 0.3;
  for (const char* wrapper : {"ddp", "full", "grad-op", "no-shard"}) {
    for (const char* optimizer : {"sgd", "adam"}) {
      run.wrapper = wrapper;
      run.optimizer = optimizer;
      run.batch_norm = run.optimizer == "adam";
      lockstep::testing::check_same_bits_as_one_rank(group, run, [&](bool ok, const std::string& what) {
        lockstep::testing::check(ok, what, group.rank());
      });
    }
  }
}

// V = 3 micro-batches cannot be shared by 2 ranks: every rank refuses.
void deterministic_indivisible(const ProcessGroup& group) {
  lockstep::testing::expect_error(group, [&] {
    lockstep::testing::DeterministicNet net;
    DistributedDataParallel<lockstep::testing::DeterministicNet>(
        net, group, DistributedOptions().deterministic(true).micro_batches(3));
  }, {"micro_batches(3) is not a multiple of the world size 2", "rank " + std::to_string(group.rank())});
}

lockstep::testing::WorkerTable scenarios() {
  using lockstep::comm_hooks::bf16_compress;
  using lockstep::comm_hooks::fp16_compress;
  auto tcp_store = on_group(collectives);
  tcp_store.make_group = [](const std::string&) { return group_over_own_tcp_store(); };
  auto given_ranks = on_group(timeline_steps);
  given_ranks.make_group = [](const std::string&) { return group_of_given_ranks(); };
  auto many_threads = on_group(spans_on_many_threads);
  many_threads.make_group = [](const std::string&) { return ProcessGroup(); };
  auto late_join = on_group(collectives);
  late_join.make_group = [](const std::string&) { return group_joined_late_over_gloo(); };
  auto second_group = on_group(lockstep::testing::desync_in_a_second_group); // makes its groups itself
  second_group.make_group = [](const std::string&) { return ProcessGroup(); };
  auto new_group_late = on_group(collectives);
  new_group_late.make_group = [](const std::string& backend) { return group_joined_late(backend.c_str()); };
  return {
      {"equivalence", on_group([](const ProcessGroup& g) { train_and_compare(g, DistributedOptions(), 1e-5, 1e-6); })},
      {"views", on_group([](const ProcessGroup& g) {
         train_and_compare(g, DistributedOptions().gradient_as_bucket_view(true).bucket_cap_mb(1e-4), 1e-5, 1e-6);
       })},
      {"no_sync", on_group(no_sync)},
      {"unused", on_group([](const ProcessGroup& g) { unused(g, false); })},
      {"unused_allowed", on_group([](const ProcessGroup& g) { unused(g, true); })},
      {"mismatch", on_group(mismatch)},
      {"stall", timing_out(stall)},
      {"peer_exits", on_group(peer_exits)},
      {"fp16", on_group([](const ProcessGroup& g) { train_and_compare(g, DistributedOptions().comm_hook(fp16_compress), 1e-2, 1e-3); })},
      {"bf16", on_group([](const ProcessGroup& g) { train_and_compare(g, DistributedOptions().comm_hook(bf16_compress), 5e-2, 1e-2); })},
      {"collectives", on_group(collectives)},
      {"early_exit", timing_out(early_exit)},
      {"syncbn", on_group(lockstep::testing::sync_batch_norm)},
      {"syncbn_cuda", on_group(lockstep::testing::sync_batch_norm_cuda)},
      {"syncbn_ddp", on_group(lockstep::testing::sync_batch_norm_ddp)},
      {"join", on_group([](const ProcessGroup& g) { lockstep::testing::join(g, {5, 7, 3}, true); })},
      {"join_by_training", on_group([](const ProcessGroup& g) { lockstep::testing::join(g, {5, 7, 3}, false); })},
      // Rank 0 has nothing: another rank roots the broadcasts.
      {"join_empty", on_group([](const ProcessGroup& g) { lockstep::testing::join(g, {0, 3, 2}, true); })},
      {"join_throw", on_group([](const ProcessGroup& g) { lockstep::testing::join_throw(g, {5, 7, 3}); })},
      {"rebuild", on_group([](const ProcessGroup& g) { rebuild(g, false); })},
      {"rebuild_views", on_group([](const ProcessGroup& g) { rebuild(g, true); })},
      {"static_graph", on_group(static_graph)},
      {"static_graph_missing", on_group([](const ProcessGroup& g) { static_graph_broken(g, true); })},
      {"static_graph_extra", on_group([](const ProcessGroup& g) { static_graph_broken(g, false); })},
      {"desync_skip", timing_out(desync_skip)},
      {"desync_avg", on_group(lockstep::testing::desync_avg)},
      {"desync_after_caught", timing_out(lockstep::testing::desync_after_caught)},
      {"desync_shape", on_group([](const ProcessGroup& g) { lockstep::testing::desync_detail(g, false); })},
      {"desync_op", on_group([](const ProcessGroup& g) { lockstep::testing::desync_detail(g, true); })},
      {"desync_second_group", second_group},
      {"timeline", on_group(timeline_steps)},
      {"given_ranks", given_ranks},
      {"many_threads", many_threads},
      {"late_join", late_join},
      {"shared", on_group(lockstep::testing::shared_parameters)},
      {"unused_no_sync", on_group([](const ProcessGroup& g) {
         lockstep::testing::unused_across_no_sync(g, false);
         lockstep::testing::unused_across_no_sync(g, true);
       })},
      {"wrapped_twice", on_group(lockstep::testing::wrapped_twice)},
      {"options_differ", on_group(lockstep::testing::options_differ)},
      {"plans_in_another_order", on_group(lockstep::testing::plans_in_another_order)},
      {"powersgd", {powersgd}},
      {"deterministic", on_group(deterministic)},
      {"deterministic_indivisible", on_group(deterministic_indivisible)},
      {"tcp_store", tcp_store},
      {"new_group_late", new_group_late},
  };
}

} // namespace

int main(int argc, char** argv) {
  return lockstep::testing::run_worker(argc, argv, scenarios());
}
