#pragma once

// PowerSGD across ranks, as checks that run the same on ranks as threads
// (test_powersgd_threads.cpp, Gloo) and under mpirun (ddp_worker.cpp
// powersgd): the compressed average is the ranks' average where it can be
// exact, and every rank ends each step with the same parameters.

#include <lockstep/lockstep.h>

#include "collective_contract.h"
#include "ddp_models.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

/// A bucket as DistributedDataParallel builds it: the gradients' views of one
/// flat buffer of the first one's dtype, then `extra` trailing elements
/// (static_graph's flag).
/// The entry `key` of what powersgd.save() writes ("parameter.1.error").
inline torch::Tensor saved(const PowerSGD& powersgd, const std::string& key) {
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  powersgd.save(out);
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  torch::Tensor value;
  in.read(key, value);
  return value;
}

inline GradBucket bucket_of(const std::vector<torch::Tensor>& gradients, int64_t extra = 0,
                            torch::Device device = torch::kCPU) {
  int64_t total = extra;
  for (const auto& g : gradients) {
    total += g.numel();
  }
  const auto dtype = gradients.empty() ? torch::kFloat : gradients[0].scalar_type();
  GradBucket bucket{0, torch::empty({total}, torch::TensorOptions(device).dtype(dtype)), {}, "bucket 0", {}, true, {}};
  int64_t offset = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    bucket.parameters.push_back(i);
    auto view = bucket.buffer.narrow(0, offset, gradients[i].numel()).view(gradients[i].sizes());
    view.copy_(gradients[i]);
    bucket.gradients.push_back(view);
    offset += gradients[i].numel();
  }
  bucket.buffer.narrow(0, offset, extra).fill_(1);
  return bucket;
}

/// Rank k holds A (B + k)^T, rank 3 with A common to every rank, so the
/// average is rank 3 too: PowerSGD at rank 3 must return it (to rounding),
/// and the vector and the trailing flag are plain averages.
inline void check_powersgd_averages_exactly_at_the_rank(ProcessGroup& group, const Check& check) {
  const int k = group.rank();
  const double world = group.size();
  auto generator = at::detail::createCPUGenerator(5); // the same A and B on every rank
  auto a = torch::randn({16, 3}, generator, torch::kFloat);
  auto b = torch::randn({10, 3}, generator, torch::kFloat);
  auto mine = torch::matmul(a, (b + k).t());
  auto mean = torch::matmul(a, (b + (world - 1) / 2).t());
  auto bucket = bucket_of({mine, torch::full({5}, k + 1.0)}, 1);
  bucket.buffer[-1].fill_(static_cast<double>(k));
  PowerSGD powersgd(PowerSGDOptions().rank(3).start_iteration(0).error_feedback(false).warm_start(false));
  auto result = powersgd(group, bucket)->wait();
  const double error = (bucket.gradients[0] - mean).abs().max().item<double>();
  check(error < 1e-4 * mean.abs().max().item<double>(), "rank " + std::to_string(k) + ": the compressed average of "
        "rank-3 matrices at rank 3 is off by " + std::to_string(error));
  check(torch::allclose(bucket.gradients[1], torch::full({5}, (world + 1) / 2)), "the vector is averaged whole");
  check(result[-1].item<double>() == (world - 1) / 2, "the trailing element is averaged whole");
  check(powersgd.compression_rate() > 1, "some of the bucket was compressed");
}

/// Note [PowerSGD's state]: a matrix whose gradient is zero on every rank
/// in one iteration (its Q comes out zero), then an iteration where one
/// rank's gradient overflows to inf, must leave warm start and error
/// feedback able to compress the next gradients: each later iteration of
/// a rank-3 matrix common to every rank returns it (to rounding).
inline void check_powersgd_recovers_from_zero_and_inf(ProcessGroup& group, const Check& check) {
  const int k = group.rank();
  auto generator = at::detail::createCPUGenerator(7); // the same on every rank
  auto m = torch::matmul(torch::randn({16, 3}, generator, torch::kFloat), torch::randn({3, 10}, generator, torch::kFloat));
  PowerSGD powersgd(PowerSGDOptions().rank(3).start_iteration(0)); // warm start and error feedback on
  auto run = [&](const torch::Tensor& gradient) {
    auto bucket = bucket_of({gradient, torch::ones({5})});
    powersgd(group, bucket)->wait();
    return bucket.gradients[0].clone();
  };
  run(torch::zeros({16, 10}));
  auto after_zero = run(m);
  check((after_zero - m).abs().max().item<double>() < 1e-3 * m.abs().max().item<double>(),
        "rank " + std::to_string(k) + ": after a zero gradient, a rank-3 gradient comes back whole (max error " +
            std::to_string((after_zero - m).abs().max().item<double>()) + ")");
  auto overflowed = m.clone();
  if (k == 0) {
    overflowed[2][3] = std::numeric_limits<float>::infinity();
  }
  check(!torch::isfinite(run(overflowed)).all().item<bool>(), "an overflow on rank 0 reaches every rank's result");
  for (int step = 0; step < 2; ++step) {
    auto after_inf = run(m);
    check(torch::isfinite(after_inf).all().item<bool>() &&
              (after_inf - m).abs().max().item<double>() < 1e-3 * m.abs().max().item<double>(),
          "rank " + std::to_string(k) + ": the iterations after an overflow compress again");
  }
}

/// DDP with PowerSGD, compressing from the third iteration, with a no_sync
/// micro-batch in the middle: every rank holds the same parameters after
/// every step, and under static_graph no rank sees a surprise (the flag
/// passes through untouched by error feedback).
inline void check_powersgd_ranks_agree(ProcessGroup& group, bool static_graph, const Check& check) {
  torch::manual_seed(10 + group.rank()); // DDP broadcasts rank 0's values
  OddNet net;
  auto powersgd = comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(2));
  DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(powersgd).static_graph(static_graph));
  torch::optim::SGD optimizer(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int world = group.size();
  for (int step = 0; step < 8; ++step) {
    auto batch = global_batch(4 * world, step);
    auto x = batch.first.narrow(0, 4 * group.rank(), 4);
    auto y = batch.second.narrow(0, 4 * group.rank(), 4);
    optimizer.zero_grad();
    if (step == 5) {
      auto guard = ddp->no_sync();
      torch::mse_loss(ddp(x * 0.5), y).backward();
    }
    torch::mse_loss(ddp(x), y).backward();
    optimizer.step();
    for (const auto& p : net->named_parameters()) {
      auto all = group.all_gather(p.value().detach());
      for (size_t r = 1; r < all.size(); ++r) {
        check(torch::equal(all[0], all[r]), "step " + std::to_string(step) + ": '" + p.key() + "' differs on rank " +
              std::to_string(r) + (static_graph ? " (static_graph)" : ""));
      }
    }
  }
  check(powersgd.iteration() == 8, "8 reducing iterations counted, got " + std::to_string(powersgd.iteration()));
  check(powersgd.compression_rate() > 1, "the gradients were compressed");
}

/// DDP with PowerSGD under join(), compressing from the fourth iteration:
/// rank k has counts[k % 3] of {5, 2, 4} batches. A rank that has run out
/// runs every bucket through the hook with zeros, so the final parameters
/// equal those of a run without join in which it trains on zero gradients
/// (the same collectives, the same PowerSGD state), and every rank's hook
/// counts every iteration, its shadowed ones too, or the ranks would leave
/// plain allreduce for compression at different iterations.
inline void check_powersgd_under_join(ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const int world = group.size();
  const std::vector<int> counts = {5, 2, 4};
  const int mine = counts[r % 3];
  int most = 0;
  for (int k = 0; k < world; ++k) {
    most = std::max(most, counts[k % 3]);
  }
  torch::manual_seed(20 + r); // DDP broadcasts rank 0's
  OddNet initial;
  auto train = [&](bool joined) {
    OddNet net(std::dynamic_pointer_cast<OddNetImpl>(initial->clone()));
    auto powersgd = comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(3));
    DistributedDataParallel<OddNet> ddp(net, group, DistributedOptions().comm_hook(powersgd));
    torch::optim::SGD optimizer(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto step = [&](int b, double scale) {
      auto batch = global_batch(4 * world, b);
      optimizer.zero_grad();
      (torch::mse_loss(ddp(batch.first.narrow(0, 4 * r, 4)), batch.second.narrow(0, 4 * r, 4)) * scale).backward();
      optimizer.step();
    };
    if (joined) {
      auto guard = ddp->join();
      for (int b = 0; b < mine; ++b) {
        step(b, 1.0);
      }
      guard.finish();
    } else {
      for (int b = 0; b < most; ++b) {
        step(b, b < mine ? 1.0 : 0.0);
      }
    }
    check(powersgd.iteration() == most, "rank " + std::to_string(r) + (joined ? " under join" : "") + ": " +
          std::to_string(most) + " iterations counted, got " + std::to_string(powersgd.iteration()));
    check(powersgd.compression_rate() > 1, "the gradients were compressed");
    return net;
  };
  auto under_join = train(true);
  auto with_zeros = train(false);
  // Rank 0 trains to the end in both runs, and join ends with its parameters.
  auto expected = with_zeros->named_parameters();
  auto got = under_join->named_parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    auto want = expected[i].value().detach().clone();
    group.broadcast(want, 0);
    const bool close = torch::allclose(got[i].value(), want, 1e-5, 1e-7);
    const std::string by = close ? "" : " by " + std::to_string((got[i].value() - want).abs().max().item<double>());
    check(close, "rank " + std::to_string(r) + ": '" + got[i].key() + "' after join differs from training on zero "
          "gradients" + by);
  }
}

} // namespace testing
} // namespace lockstep
