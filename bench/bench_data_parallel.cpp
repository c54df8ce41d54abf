// Training-step throughput: the bare module on every core against
// lockstep::DataParallel with CPU replicas, side by side in one run.
//
//   build/lockstep-bench-dp [--rounds N] [--seconds S] [--replicas R]
//
// Each round times every contender for about S seconds, in alternating order;
// the report gives the median samples/s of each and the ratio of medians.
// "ceiling" is one replica's share of the batch on one thread, counted as if
// R replicas ran side by side for free: what DataParallel could reach.

#include "../examples/models.h"

#include <lockstep/lockstep.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Contender {
  std::string name;
  std::function<void()> step;
  std::vector<double> rates; // samples/s per round
  int threads = 0; // intra-op threads of the timing thread; 0: every core
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Runs `step` for about `seconds` and returns samples/s.
double time_steps(const std::function<void()>& step, int64_t batch, double seconds) {
  step(); // warm-up
  int64_t steps = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    step();
    ++steps;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return static_cast<double>(steps * batch) / elapsed;
}

template <typename Net>
std::function<void()> training_step(Net net, std::function<torch::Tensor(const torch::Tensor&)> forward, int64_t batch, int64_t in_features_or_image) {
  auto optimizer = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = in_features_or_image == 784 ? torch::randn({batch, 784}) : torch::randn({batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {batch});
  return [=] {
    optimizer->zero_grad();
    auto loss = torch::cross_entropy_loss(forward(x), y);
    loss.backward();
    optimizer->step();
  };
}

void run_model(const std::string& model, int64_t batch, int rounds, double seconds, int replicas) {
  std::vector<Contender> contenders;
  std::vector<torch::Device> cpus(replicas, torch::Device(torch::kCPU));
  if (model == "mlp") {
    auto bare = lockstep::examples::make_mlp();
    contenders.push_back({"bare", training_step(bare, [bare](const torch::Tensor& x) mutable { return bare->forward(x); }, batch, 784), {}});
    lockstep::DataParallel<torch::nn::Sequential> dp(lockstep::examples::make_mlp(), lockstep::DataParallelOptions().devices(cpus));
    contenders.push_back({"dataparallel", training_step(dp, [dp](const torch::Tensor& x) mutable { return dp(x); }, batch, 784), {}});
  } else {
    lockstep::examples::ConvNet bare;
    contenders.push_back({"bare", training_step(bare, [bare](const torch::Tensor& x) mutable { return bare->forward(x); }, batch, 28), {}});
    lockstep::DataParallel<lockstep::examples::ConvNet> dp(lockstep::examples::ConvNet(), lockstep::DataParallelOptions().devices(cpus));
    contenders.push_back({"dataparallel", training_step(dp, [dp](const torch::Tensor& x) mutable { return dp(x); }, batch, 28), {}});
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // The ceiling for R replicas: one replica's share of the batch on one
  // thread, as if R of them ran side by side with no cost at all.
  {
    auto half = batch / replicas;
    std::function<void()> inner;
    if (model == "mlp") {
      auto net = lockstep::examples::make_mlp();
      inner = training_step(net, [net](const torch::Tensor& x) mutable { return net->forward(x); }, half, 784);
    } else {
      lockstep::examples::ConvNet net;
      inner = training_step(net, [net](const torch::Tensor& x) mutable { return net->forward(x); }, half, 28);
    }
    contenders.push_back({"ceiling", inner, {}, 1});
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < contenders.size(); ++i) {
      auto& c = contenders[(i + r) % contenders.size()];
      // DataParallel drops its calling thread to one intra-op thread (Note
      // [CPU replicas and threads]); give the bare module every core back.
      at::set_num_threads(c.threads > 0 ? c.threads : cores);
      c.rates.push_back(time_steps(c.step, batch, seconds)); // ceiling: batch/R rows x R replicas
    }
  }
  const double base = median(contenders[0].rates);
  for (const auto& c : contenders) {
    const double m = median(c.rates);
    std::printf("%-5s batch %-4lld %-14s %10.1f samples/s   ratio %.3f   (rounds:", model.c_str(),
                static_cast<long long>(batch), c.name.c_str(), m, m / base);
    for (double v : c.rates) {
      std::printf(" %.0f", v);
    }
    std::printf(")\n");
  }
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  double seconds = 2.0;
  int replicas = 2;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rounds")) {
      rounds = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--seconds")) {
      seconds = std::atof(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--replicas")) {
      replicas = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--model")) {
      only = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: %s [--rounds N] [--seconds S] [--replicas R] [--model mlp|cnn]\n", argv[0]);
      return 2;
    }
  }
  try {
    lockstep::require_fast_blas("lockstep-bench-dp");
    // "All cores" explicitly: libtorch's own default can be lower (it asks
    // cpuinfo for physical cores, which fails on some virtual machines).
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    torch::manual_seed(0);
    std::printf("threads %d, BLAS %s, %d CPU replicas\n", at::get_num_threads(), lockstep::loaded_blas().c_str(), replicas);
    if (only.empty() || only == "mlp") {
      run_model("mlp", 256, rounds, seconds, replicas);
    }
    if (only.empty() || only == "cnn") {
      run_model("cnn", 128, rounds, seconds, replicas);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
