// Scenarios of lockstep_ddp_worker on what wrapping in DistributedDataParallel
// must not change, each checked against the same model trained without it:
// a parameter registered twice, in every mode; no_sync's gradients of
// parameters the reducing backward does not use; parameters no rank uses;
// .grad before the first backward; and the refusals at construction. Ported
// from PyTorch's test_ddp_checkpointing_weight_sharing,
// test_grads_same_across_ranks_with_no_sync,
// test_ddp_control_flow_same_across_ranks and
// test_DistributedDataParallel_with_amp_and_grad_is_view.

#include "support/worker.h"

#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <optional>

#include <string>
#include <vector>

namespace lockstep {
namespace testing {
namespace {

constexpr int64_t kRows = 3; // per rank and micro-batch

// One weight registered twice, as 'enc.weight' and as 'tied', used twice.
struct TiedImpl : torch::nn::Cloneable<TiedImpl> {
  TiedImpl() {
    reset();
  }
  void reset() override {
    enc = register_module("enc", torch::nn::Linear(5, 5));
    tied = register_parameter("tied", enc->weight);
    head = register_module("head", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::matmul(torch::tanh(enc(x)), tied.t()));
  }
  torch::nn::Linear enc{nullptr}, head{nullptr};
  torch::Tensor tied;
};
TORCH_MODULE(Tied);

// Four branches; `used` says which of b, c and d run besides a.
struct BranchesImpl : torch::nn::Cloneable<BranchesImpl> {
  BranchesImpl() {
    reset();
  }
  void reset() override {
    a = register_module("a", torch::nn::Linear(5, 2));
    b = register_module("b", torch::nn::Linear(5, 2));
    c = register_module("c", torch::nn::Linear(5, 2));
    d = register_module("d", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(const torch::Tensor& x, const std::string& used) {
    auto out = a(x);
    for (char name : used) {
      out = out + (name == 'b' ? b : name == 'c' ? c : d)(x);
    }
    return out;
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, d{nullptr};
};
TORCH_MODULE(Branches);

std::pair<torch::Tensor, torch::Tensor> rows(int64_t step, int64_t micro, int rank) {
  auto x = torch::sin(torch::arange(kRows * 5, torch::kFloat).reshape({kRows, 5}) * 0.3 + 1.7 * step + 0.9 * micro + rank);
  auto y = torch::cos(torch::arange(kRows * 2, torch::kFloat).reshape({kRows, 2}) * 0.7 - 1.1 * step + micro - rank);
  return {x, y};
}

void copy_values(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) {
    dst[i].copy_(src[i]);
  }
}

void check_grads_close(torch::nn::Module& expected, torch::nn::Module& got, int rank, const std::string& what) {
  auto e = expected.named_parameters();
  auto g = got.named_parameters();
  for (size_t i = 0; i < e.size(); ++i) {
    const auto& want = e[i].value().grad();
    const auto& have = g[i].value().grad();
    const bool ok = have.defined() && torch::allclose(want, have, 1e-5, 1e-6);
    check(ok, what + ": gradient of '" + e[i].key() + "'" +
              (ok || !have.defined() ? "" : " off by " + std::to_string((want - have).abs().max().item<double>())),
          rank);
  }
}

void zero_grads(torch::nn::Module& module) {
  for (auto& p : module.parameters()) {
    if (p.grad().defined()) {
      p.mutable_grad().zero_(); // in place: a bucket view stays one
    }
  }
}

void sgd_step(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (p.grad().defined()) {
      p.sub_(p.grad() * 0.1);
    }
  }
}

struct Mode {
  std::string name;
  DistributedOptions options;
  bool accumulate = false; // one no_sync micro-batch before the reducing one
  bool join = false;
};

// Three steps (the buckets are rebuilt at the second) of DDP on this rank's
// rows against the bare model on every rank's rows.
void train_tied(const ProcessGroup& group, const Mode& mode) {
  const int r = group.rank();
  const int world = group.size();
  torch::manual_seed(11 + r);
  Tied net;
  DistributedDataParallel<Tied> ddp(net, group, mode.options);
  if (mode.options.gradient_as_bucket_view()) {
    for (const auto& p : net->named_parameters()) {
      check(!p.value().grad().defined(), mode.name + ": '" + p.key() + "'.grad is undefined before any backward", r);
    }
  }
  Tied reference;
  copy_values(*net, *reference);
  std::optional<JoinGuard> join;
  if (mode.join) {
    join.emplace(ddp->join());
  }
  const int micros = mode.accumulate ? 2 : 1;
  for (int64_t step = 0; step < 3; ++step) {
    zero_grads(*net);
    zero_grads(*reference);
    for (int m = 0; m < micros; ++m) {
      auto [x, y] = rows(step, m, r);
      if (m + 1 < micros) {
        auto guard = ddp->no_sync();
        torch::mse_loss(ddp(x), y).backward();
      } else {
        torch::mse_loss(ddp(x), y).backward();
      }
      for (int k = 0; k < world; ++k) {
        auto [xk, yk] = rows(step, m, k);
        (torch::mse_loss(reference(xk), yk) / world).backward();
      }
    }
    check_grads_close(*reference, *net, r, mode.name + ", step " + std::to_string(step));
    sgd_step(*net);
    sgd_step(*reference);
  }
  if (join) {
    join->finish();
  }
}

} // namespace

void shared_parameters(const ProcessGroup& group) {
  const auto views = DistributedOptions().gradient_as_bucket_view(true);
  const std::vector<Mode> modes{
      {"plain", DistributedOptions()},
      {"views", views},
      {"views, one bucket per parameter", DistributedOptions(views).bucket_cap_mb(1e-5)},
      {"views and static_graph", DistributedOptions(views).static_graph(true)},
      {"views and a comm hook", DistributedOptions(views).comm_hook(comm_hooks::allreduce)},
      {"views and no_sync", views, /*accumulate=*/true},
      {"views and join", views, false, /*join=*/true},
      {"static_graph and no_sync", DistributedOptions().static_graph(true), true},
  };
  for (const auto& mode : modes) {
    train_tied(group, mode);
  }
}

// Rank 0 uses 'b' under no_sync, nobody uses it in the reducing backward: its
// average of the ranks' accumulated gradients must still arrive. Nobody ever
// uses 'c' or 'd': 'c' keeps the gradient it had (different on each rank),
// 'd' keeps none.
void unused_across_no_sync(const ProcessGroup& group, bool views) {
  const int r = group.rank();
  const int world = group.size();
  torch::manual_seed(5);
  Branches net;
  net->c->weight.mutable_grad() = torch::full({2, 5}, 7.0 + r);
  DistributedDataParallel<Branches> ddp(
      net, group, DistributedOptions().find_unused_parameters(true).gradient_as_bucket_view(views));
  Branches local;
  copy_values(*net, *local);
  const std::string early = r == 0 ? "b" : "";
  for (int m = 0; m < 2; ++m) {
    auto [x, y] = rows(0, m, r);
    const std::string used = m == 0 ? early : "";
    if (m == 0) {
      auto guard = ddp->no_sync();
      torch::mse_loss(ddp(x, used), y).backward();
    } else {
      torch::mse_loss(ddp(x, used), y).backward();
    }
    torch::mse_loss(local(x, used), y).backward();
  }
  const std::string what = views ? "with bucket views: " : "";
  for (auto* layer : {&local->a, &local->b}) {
    for (const auto& p : (*layer)->named_parameters()) {
      auto mine = p.value().grad().defined() ? p.value().grad() : torch::zeros_like(p.value());
      auto all = group.all_gather(mine);
      auto expected = torch::stack(all).sum(0) / world;
      auto got = net->named_parameters()[(layer == &local->a ? "a." : "b.") + p.key()].grad();
      check(got.defined() && torch::allclose(got, expected, 1e-5, 1e-6),
            what + "'" + (layer == &local->a ? "a." : "b.") + p.key() + "' holds the average of the accumulated gradients", r);
    }
  }
  check(torch::equal(net->c->weight.grad(), torch::full({2, 5}, 7.0 + r)), what + "'c.weight' keeps its gradient", r);
  check(!net->c->bias.grad().defined(), what + "'c.bias' keeps no gradient", r);
  check(!net->d->weight.grad().defined() && !net->d->bias.grad().defined(), what + "'d' keeps no gradient", r);
}

void wrapped_twice(const ProcessGroup& group) {
  const int r = group.rank();
  torch::manual_seed(3);
  Branches net;
  {
    DistributedDataParallel<Branches> first(net, group, DistributedOptions().find_unused_parameters(true));
    expect_error(group, [&] { DistributedDataParallel<Branches> second(net, group); },
                 {"rank " + std::to_string(r) + ": parameter 'a.weight' is already reduced by another "
                  "DistributedDataParallel"});
    auto [x, y] = rows(0, 0, r);
    torch::mse_loss(first(x, ""), y).backward();
    auto all = group.all_gather(net->a->weight.grad());
    check(torch::equal(all[0], all[1]), "the first wrapper still reduces", r);
  }
  // Once the first wrapper is gone, a new one may wrap the module.
  DistributedDataParallel<Branches> again(net, group, DistributedOptions().find_unused_parameters(true));
}

void options_differ(const ProcessGroup& group) {
  const int r = group.rank();
  torch::manual_seed(3);
  Branches net;
  expect_error(group, [&] {
    DistributedDataParallel<Branches> ddp(net, group, DistributedOptions().bucket_cap_mb(r == 1 ? 1.0 : 25.0));
  }, {"rank 1's DistributedOptions differ from rank 0's: rank 0 has bucket_bytes=26214400",
      "every rank must pass the same ones"});
}

// Note [A switch of plans is checked], where planned allreduces go without
// the check before each (Gloo; MPI between ranks of one host, through shared
// memory): two models whose backwards run in another order on one rank are
// an error on every rank, never one model's gradients added to the other's.
// The rank that switches plans is at a check, which the other's planned
// allreduce meets in shared memory: both fail at once.
void plans_in_another_order(const ProcessGroup& group) {
  const int r = group.rank();
  torch::manual_seed(3);
  torch::nn::Linear one(64, 64), other(64, 64);
  DistributedDataParallel<torch::nn::Linear> first(one, group);
  DistributedDataParallel<torch::nn::Linear> second(other, group);
  const auto x = torch::randn({4, 64});
  for (int step = 0; step < 2; ++step) { // the plans agreed, then sent as planned
    first->forward(x).sum().backward();
    second->forward(x).sum().backward();
  }
  auto a = first->forward(x).sum();
  auto b = second->forward(x).sum();
  expect_error(group, [&] {
    (r == 1 ? b : a).backward();
    (r == 1 ? a : b).backward();
  }, {"rank " + std::to_string(r), "allreduce of bucket 0", "the ranks called different collectives here"});
}

} // namespace testing
} // namespace lockstep
