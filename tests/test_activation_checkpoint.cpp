// lockstep::checkpoint (Note [Activation checkpointing]): the segment's
// activations are freed after forward, and the gradients are bitwise those
// without checkpointing: bare, with dropout, under bf16 autocast, with a
// tensor the segment reads from outside, and through DDP, FSDP and
// DataParallel with ranks as threads.

#include <lockstep/lockstep.h>

#include <examples/models.h>

#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <optional>
#include <string>
#include <vector>

namespace lockstep {
namespace {

// Two blocks with dropout; `checkpointed` runs each block as a segment.
struct BlocksImpl : torch::nn::Cloneable<BlocksImpl> {
  explicit BlocksImpl(bool checkpointed = false) : checkpointed(checkpointed) {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(7, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    head = register_module("head", torch::nn::Linear(32, 3));
    torch::NoGradGuard no_grad;
    int64_t i = 0;
    for (auto& p : parameters()) {
      p.copy_(torch::cos(torch::arange(p.numel(), torch::kFloat) * 0.37 + static_cast<double>(++i)).view_as(p) * 0.3);
    }
  }
  torch::Tensor block(torch::nn::Linear& fc, const torch::Tensor& x) {
    return torch::dropout(torch::gelu(fc(x)), 0.2, is_training());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (auto* fc : {&fc1, &fc2}) {
      // The segment runs again in backward: it holds the layer, not the loop's reference to it.
      h = checkpointed ? lockstep::checkpoint([this, fc = *fc](const torch::Tensor& in) mutable { return block(fc, in); }, h)
                       : block(*fc, h);
    }
    return head(h);
  }
  bool checkpointed;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(Blocks);

torch::Tensor gradients(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : params) {
    flat.push_back(p.grad().defined() ? p.grad().reshape({-1}).to(torch::kFloat) : torch::zeros({p.numel()}));
  }
  return torch::cat(flat);
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
      std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// One step of Blocks on a fixed batch from a fixed seed: the gradients and
// the generator's next draw.
std::pair<torch::Tensor, double> step(bool checkpointed, bool bf16 = false) {
  torch::manual_seed(11);
  Blocks net(checkpointed);
  const auto x = torch::sin(torch::arange(8 * 7, torch::kFloat) * 0.3).view({8, 7});
  const auto y = torch::cos(torch::arange(8 * 3, torch::kFloat) * 0.2).view({8, 3});
  {
    std::optional<AutocastGuard> autocast;
    if (bf16) {
      autocast.emplace(torch::kCPU, torch::kBFloat16);
    }
    torch::mse_loss(net->forward(x).to(torch::kFloat), y).backward();
  }
  return {gradients(net->parameters()), torch::rand({1}).item<double>()};
}

TEST(ActivationCheckpoint, GivesTheSameGradientsWithDropout) {
  const auto [plain, plain_next] = step(false);
  const auto [checkpointed, checkpointed_next] = step(true);
  EXPECT_TRUE(same_bits(plain, checkpointed)) << (plain - checkpointed).abs().max().item<double>();
  EXPECT_EQ(plain_next, checkpointed_next); // the generator goes on as if the segments ran once
  EXPECT_GT(plain.abs().sum().item<double>(), 0);
}

TEST(ActivationCheckpoint, GivesTheSameGradientsUnderBf16Autocast) {
  EXPECT_TRUE(same_bits(step(false, true).first, step(true, true).first));
  EXPECT_FALSE(same_bits(step(false, true).first, step(false, false).first)); // bf16 did change them
}

// One layer in two segments under autocast, backward after the guard (a
// shared encoder): autocast caches the layer's bf16 weight, and the second
// segment's first run would reuse the first's cast, whose graph is not its
// own, so its gradient was dropped. The cache is off inside a segment, so
// each segment casts the weight for itself and its gradients meet in fp32,
// where the plain run's meet in the shared cast, in bf16: close (a lost
// segment is 4e-2 away), not the same bits.
TEST(ActivationCheckpoint, ALayerInTwoSegmentsUnderAutocastGetsBothGradients) {
  std::vector<torch::Tensor> grads;
  for (bool checkpointed : {false, true}) {
    torch::manual_seed(5);
    torch::nn::Linear encoder(6, 6);
    auto fn = [encoder](const torch::Tensor& t) mutable { return torch::gelu(encoder(t)); };
    const auto x1 = torch::sin(torch::arange(24, torch::kFloat)).view({4, 6});
    const auto x2 = torch::cos(torch::arange(24, torch::kFloat)).view({4, 6});
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      auto a = checkpointed ? checkpoint(fn, x1) : fn(x1);
      auto b = checkpointed ? checkpoint(fn, x2) : fn(x2);
      loss = (a - b * 0.5).pow(2).mean().to(torch::kFloat);
    }
    loss.backward();
    grads.push_back(gradients(encoder->parameters()));
  }
  EXPECT_TRUE(torch::allclose(grads[0], grads[1], 1e-2, 1e-3)) << (grads[0] - grads[1]).abs().max().item<double>();
}

// An input changed in place after the segment ran would be recomputed from
// its new values: an error naming the input, as PyTorch's checkpoint's.
TEST(ActivationCheckpoint, AnInputChangedInPlaceAfterTheSegmentIsAnError) {
  torch::nn::Linear fc(4, 4);
  auto h = torch::randn({2, 4}, torch::requires_grad()) * 1.0;
  auto y = checkpoint([fc](const torch::Tensor& t) mutable { return torch::tanh(fc(t)); }, h);
  h.add_(1.0);
  EXPECT_ERROR_SAYS(y.sum().backward(), "input 0 of the segment was changed in place once given to it", "clone");
}

// Double backward through a segment would lose the second-order terms: the
// gradients' graph ends at the recomputation's own inputs. An error.
TEST(ActivationCheckpoint, ABackwardThatCreatesAGraphIsAnError) {
  auto x = torch::randn({3, 4}, torch::requires_grad());
  auto w = torch::randn({4, 2});
  auto y = checkpoint([w](const torch::Tensor& t) { return (t * t).matmul(w); }, x);
  EXPECT_ERROR_SAYS(torch::autograd::grad({y.sum()}, {x}, {}, true, /*create_graph=*/true), "create_graph",
                    "double backward");
}

TEST(ActivationCheckpoint, FreesTheSegmentsActivations) {
  auto w = torch::randn({16, 16}, torch::requires_grad());
  const auto x = torch::randn({4, 16});
  for (bool checkpointed : {false, true}) {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> inside;
    auto fn = [&](const torch::Tensor& in) {
      auto hidden = torch::tanh(in.matmul(w)); // tanh's backward saves its result
      inside.emplace(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(hidden.storage().unsafeGetStorageImpl()));
      return torch::tanh(hidden).sum(1);
    };
    auto out = checkpointed ? checkpoint(fn, x) : fn(x);
    ASSERT_TRUE(inside.has_value());
    EXPECT_EQ(inside->expired(), checkpointed) << "checkpointed " << checkpointed;
    out.sum().backward();
  }
}

// The trainer's ViT, whose blocks are segments: every parameter's gradient,
// to the bit, in training mode (dropout in attention and the MLP).
TEST(ActivationCheckpoint, GivesTheSameGradientsThroughTheVitsBlocks) {
  torch::Tensor grads[2];
  std::vector<std::string> names;
  for (bool checkpointed : {false, true}) {
    torch::manual_seed(5);
    examples::VisionTransformer vit(32, 2, 4, 0.1, checkpointed);
    vit->forward(torch::randn({3, 1, 28, 28})).pow(2).sum().backward();
    names.clear();
    for (const auto& p : vit->named_parameters()) {
      if (!p.value().grad().defined()) {
        names.push_back(p.key());
      }
    }
    EXPECT_TRUE(names.empty()) << "checkpointed " << checkpointed << ": no gradient for " << c10::Join(", ", names);
    grads[checkpointed] = gradients(vit->parameters());
  }
  EXPECT_TRUE(same_bits(grads[0], grads[1]));
}

// A segment that reads a tensor computed before it, not given to it: the
// gradient reaches the leaf behind that tensor.
TEST(ActivationCheckpoint, GradientsReachWhatTheSegmentReadsFromOutside) {
  auto w = torch::randn({5, 5}, torch::requires_grad());
  auto x = torch::randn({3, 5}, torch::requires_grad());
  std::vector<torch::Tensor> grads[2];
  for (bool checkpointed : {false, true}) {
    w.mutable_grad().reset();
    x.mutable_grad().reset();
    const auto scaled = w * 2; // outside the segment
    auto fn = [&](const torch::Tensor& in) { return torch::relu(in.matmul(scaled)).pow(2); };
    (checkpointed ? checkpoint(fn, x) : fn(x)).sum().backward();
    grads[checkpointed] = {w.grad().clone(), x.grad().clone()};
  }
  EXPECT_TRUE(same_bits(grads[0][0], grads[1][0]));
  EXPECT_TRUE(same_bits(grads[0][1], grads[1][1]));
}

// A segment that reads a leaf and a tensor made from it before the
// segment (a weight and its transpose, a slice of a table): the path
// through the outside tensor is taken once, by the outer backward, as
// without checkpointing, and not a second time inside the recomputation,
// which would double it, or fail where the outside node saved tensors.
TEST(ActivationCheckpoint, ALeafAndATensorMadeFromItOutsideGetTheirGradientOnce) {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto x = torch::randn({3, 4}, torch::requires_grad());
  std::vector<torch::Tensor> grads[2];
  for (bool checkpointed : {false, true}) {
    w.mutable_grad().reset();
    x.mutable_grad().reset();
    const auto w_t = w.t();        // a view: its node saves nothing
    const auto a = w * 2;
    const auto b = a.exp();        // saves its result for backward
    auto fn = [&](const torch::Tensor& in) { return in.matmul(w).matmul(w_t).matmul(a) + in.matmul(b); };
    (checkpointed ? checkpoint(fn, x) : fn(x)).pow(2).sum().backward();
    grads[checkpointed] = {w.grad().clone(), x.grad().clone()};
  }
  EXPECT_TRUE(same_bits(grads[0][0], grads[1][0])) << (grads[0][0] - grads[1][0]).abs().max().item<double>();
  EXPECT_TRUE(same_bits(grads[0][1], grads[1][1]));
}

// Hooks on what a segment reads run once per backward, as without
// checkpointing: a leaf's hook, and retain_grad on a tensor made outside.
TEST(ActivationCheckpoint, HooksOnWhatTheSegmentReadsRunOnce) {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto v = torch::randn({4, 4}, torch::requires_grad());
  std::vector<torch::Tensor> grads[2];
  int calls[2] = {0, 0};
  for (bool checkpointed : {false, true}) {
    w.mutable_grad().reset();
    auto hook = w.register_hook([&calls, checkpointed](const torch::Tensor& g) {
      ++calls[checkpointed];
      return g * 0.5;
    });
    auto u = v * 2;
    u.retain_grad();
    auto fn = [&](const torch::Tensor& in) { return in.matmul(w).tanh().matmul(u); };
    (checkpointed ? checkpoint(fn, torch::ones({2, 4})) : fn(torch::ones({2, 4}))).sum().backward();
    w.remove_hook(hook);
    grads[checkpointed] = {w.grad().clone(), u.grad().clone()};
  }
  EXPECT_EQ(calls[0], 1);
  EXPECT_EQ(calls[1], 1);
  EXPECT_TRUE(same_bits(grads[0][0], grads[1][0]));
  EXPECT_TRUE(same_bits(grads[0][1], grads[1][1]));
}

// Two recomputations that overlap on two threads, the first to begin
// ending first (as DataParallel's CPU replicas' backwards may): the
// generator ends where the caller left it, not at a state one of them set
// (Note [Recomputations on several threads]).
TEST(ActivationCheckpoint, OverlappingRecomputationsLeaveTheGeneratorAsTheCallerLeftIt) {
  std::atomic<bool> in_backward{false}, a_in{false}, b_in{false}, a_done{false};
  const auto wait_for = [](const std::atomic<bool>& flag) {
    while (!flag.load()) {
      std::this_thread::yield();
    }
  };
  auto w = torch::randn({3, 3}, torch::requires_grad());
  torch::manual_seed(5);
  auto out_a = checkpoint([&](const torch::Tensor& in) {
    if (in_backward) {
      a_in = true;
      wait_for(b_in);
    }
    return in.matmul(w);
  }, torch::ones({2, 3}));
  torch::rand({7}); // the generator moves on between the segments
  auto out_b = checkpoint([&](const torch::Tensor& in) {
    if (in_backward) {
      b_in = true;
      wait_for(a_done);
    }
    return in.matmul(w);
  }, torch::ones({2, 3}));
  torch::rand({7});
  const auto caller_left = at::globalContext().defaultGenerator(torch::kCPU).get_state();
  in_backward = true;
  std::thread b([&] {
    wait_for(a_in); // B's recomputation begins inside A's
    out_b.sum().backward();
  });
  out_a.sum().backward();
  a_done = true;
  b.join();
  EXPECT_TRUE(torch::equal(at::globalContext().defaultGenerator(torch::kCPU).get_state(), caller_left));
}

// fn is copied, so a const reference to a mutable lambda is taken: the
// copy is what runs.
TEST(ActivationCheckpoint, TakesAConstMutableLambda) {
  auto w = torch::randn({3, 3}, torch::requires_grad());
  int calls = 0;
  const auto fn = [w, &calls](const torch::Tensor& in) mutable {
    ++calls;
    return in.matmul(w);
  };
  checkpoint(fn, torch::ones({2, 3})).sum().backward();
  EXPECT_EQ(calls, 2); // forward, and again in backward
  EXPECT_TRUE(torch::equal(w.grad(), torch::full({3, 3}, 2.0f)));
}

TEST(ActivationCheckpoint, RefusesABackwardAfterItsGraphWasFreedAndRunsPlainWithoutAutograd) {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& in) { return in.matmul(w).tanh(); };
  auto out = checkpoint(fn, torch::randn({2, 4})).sum();
  out.backward({}, /*retain_graph=*/true);
  const auto once = w.grad().clone();
  out.backward(); // retained: the segment runs a third time
  EXPECT_TRUE(torch::equal(w.grad(), once * 2));
  EXPECT_ERROR_SAYS(out.backward(), "the segment's backward ran a second time");
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(checkpoint(fn, torch::randn({2, 4})).requires_grad());
}

// Each wrapper's gradients, with and without checkpointing, to the bit.
template <typename Make>
void expect_same_through(const std::string& what, int world, const Make& make) {
  testing::spawn(world, [&](ProcessGroup& group) {
    torch::Tensor grads[2];
    for (bool checkpointed : {false, true}) {
      Blocks net(checkpointed);
      net->eval(); // no dropout: ranks as threads share the generator
      auto [forward, params] = make(group, net);
      const auto x = torch::sin(torch::arange(6 * 7, torch::kFloat) * (0.3 + group.rank())).view({6, 7});
      forward(x).pow(2).mean().backward();
      grads[checkpointed] = gradients(params);
    }
    EXPECT_TRUE(same_bits(grads[0], grads[1])) << what << ", rank " << group.rank();
  });
}

TEST(ActivationCheckpoint, GivesTheSameGradientsThroughEachWrapper) {
  torch::set_num_threads(1);
  using Forward = std::function<torch::Tensor(const torch::Tensor&)>;
  expect_same_through("DistributedDataParallel", 2, [](ProcessGroup& group, Blocks net) {
    DistributedDataParallel<Blocks> ddp(net, group);
    return std::make_pair(Forward([ddp](const torch::Tensor& x) mutable { return ddp->forward(x); }),
                          ddp->parameters());
  });
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    expect_same_through("FullyShardedDataParallel", 2, [strategy](ProcessGroup& group, Blocks net) {
      FullyShardedDataParallel<Blocks> fsdp(net, group, ShardingOptions().strategy(strategy));
      return std::make_pair(Forward([fsdp](const torch::Tensor& x) mutable { return fsdp->forward(x); }),
                            fsdp->parameters());
    });
  }
  expect_same_through("DataParallel", 1, [](ProcessGroup&, Blocks net) {
    DataParallel<Blocks> dp(net, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
    return std::make_pair(Forward([dp](const torch::Tensor& x) mutable { return dp->forward(x); }),
                          dp->parameters());
  });
}

} // namespace
} // namespace lockstep
