// One rank of the DDP benchmark (bench/run_ddp_bench.sh starts two per
// contender, with torchrun's environment variables).
//
//   lockstep-bench-ddp MODE MODEL STEPS
//   lockstep-bench-ddp recorder      (the flight recorder's cost per collective)
//   lockstep-bench-ddp collectives [gloo|mpi] [MiB]   (under a launcher: allreduce, all_gather, reduce_scatter of 4 MiB)
//
// MODE: lockstep | views (gradient_as_bucket_view) | static (static_graph) |
// norebuild (buckets kept in reverse registration order) | norecorder (the
// flight recorder off) | detail (LOCKSTEP_DEBUG=detail) | mpi (lockstep over
// the mpi backend, under mpirun) | naive (one allreduce per gradient after
// backward) | nocomm (no communication: the limit) | barrier-mpi (no
// communication but a barrier over MPI after each step, with the agreement
// check before it: the limit for ranks that wait for each other every
// step) | fullshard, gradop,
// noshard (FullyShardedDataParallel's strategies over Gloo) | fullshard-mpi,
// gradop-mpi (over MPI, under mpirun) | fullshard-bf16 (FullShard with
// param_dtype bf16 and reduce_dtype fp32: all-gathers of half the bytes) |
// powersgd (DDP with PowerSGD at --powersgd-rank, compressing from the
// third step) | powersgd-views (the same with gradient_as_bucket_view) | comm (communication alone: each step allreduces buffers of
// the sizes of DDP's buckets, with no compute) | checkpointed,
// fullshard-checkpointed (vit and gpt: DDP and FullShard with each block a
// lockstep::checkpoint segment).
// MODEL: mlp (784-1024-1024-10) | deep (48 x Linear(256, 256)) | reversed
// (deep, its layers registered in the reverse of the order forward uses
// them) | wide (8 x Linear(2048, 2048): Adam's state dominates memory),
// global batch 256, split over the ranks | cnn, vit (the trainer's, batch
// 64) | gpt (the trainer's, batch 16 of 128 tokens). --optimizer adam
// replaces SGD with momentum; --precision bf16 runs forward under autocast.
// Rank 0 prints one line:
//   MODE MODEL steps_per_s=X rss_mb=R0,R1 base_mb=B0,B1 (peak RSS, and before the model)

#include <examples/blas_check.h>
#include <examples/models.h>

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

namespace {

// The deep model with its layers registered last first: reverse registration
// order, the buckets' first guess, is then the reverse of backward's order.
struct ReversedDeepImpl : torch::nn::Module {
  ReversedDeepImpl() {
    layers.resize(48, nullptr);
    for (int i = 47; i >= 0; --i) {
      layers[i] = register_module("layer" + std::to_string(i), torch::nn::Linear(256, 256));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      x = torch::relu(layer(x));
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(ReversedDeep);

// "mlp" is the MLP that lockstep-bench-dp times too; "deep" has many small
// gradients, so that bucketing matters.
torch::nn::Sequential make_model(const std::string& name) {
  if (name == "mlp") {
    return lockstep::examples::make_mlp();
  }
  torch::nn::Sequential net;
  if (name == "wide") {
    for (int i = 0; i < 8; ++i) {
      net->push_back(torch::nn::Linear(i == 0 ? 256 : 2048, 2048));
      net->push_back(torch::nn::ReLU());
    }
    return net;
  }
  for (int i = 0; i < 48; ++i) {
    net->push_back(torch::nn::Linear(256, 256));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

// Times `steps` SGD steps of `net` under `mode` on this rank.
// checkpointed and fullshard-checkpointed: each transformer block a
// lockstep::checkpoint segment.
bool checkpointed(const std::string& mode) {
  return mode.size() >= 12 && mode.compare(mode.size() - 12, 12, "checkpointed") == 0;
}

bool sharded(const std::string& mode) {
  return mode.rfind("fullshard", 0) == 0 || mode.rfind("gradop", 0) == 0 || mode == "noshard";
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// The process's peak before the model is built: LibTorch, the group, and
// (with the CUDA wheel) the CUDA libraries it maps even with no GPU.
double base_rss_mb = 0;

// --model gpt's global batch: sequences of kGptContext tokens.
constexpr int64_t kGptBatch = 16;
constexpr int64_t kGptContext = 128;

struct BenchOptions {
  std::string optimizer = "sgd";
  std::string precision = "fp32";
  int64_t batch = 0; // global; 0: the model's default
  double bucket_cap_mb = 25;
  int64_t powersgd_rank = 4;
};

// `comm`: the allreduces DDP would issue, one buffer per bucket.
std::function<void()> communication_alone(const std::vector<std::vector<size_t>>& buckets,
                                          const std::vector<torch::Tensor>& params, const lockstep::ProcessGroup& group) {
  std::vector<torch::Tensor> buffers;
  for (const auto& bucket : buckets) {
    int64_t numel = 0;
    for (size_t i : bucket) {
      numel += params[i].numel();
    }
    buffers.push_back(torch::ones({numel}));
  }
  return [buffers, group] {
    std::vector<std::shared_ptr<lockstep::Work>> works;
    for (const auto& b : buffers) {
      works.push_back(group.allreduce_async({b}, lockstep::ReduceOp::Sum, "allreduce of a bucket"));
    }
    for (auto& w : works) {
      w->wait();
    }
  };
}

// `net` as `mode` wraps it: the forward to call, the parameters to optimize,
// and the wrapper that holds them (none for naive, nocomm and barrier-mpi).
template <typename M>
struct Wrapped {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> params;
  std::shared_ptr<lockstep::DistributedDataParallel<M>> ddp;
  std::shared_ptr<lockstep::FullyShardedDataParallel<M>> fsdp;
};

template <typename M>
std::shared_ptr<lockstep::FullyShardedDataParallel<M>> shard(M net, const lockstep::ProcessGroup& group,
                                                             const std::string& mode) {
  const auto strategy = mode == "noshard" ? lockstep::ShardingStrategy::NoShard
      : mode.rfind("gradop", 0) == 0      ? lockstep::ShardingStrategy::ShardGradOp
                                          : lockstep::ShardingStrategy::FullShard;
  auto options = lockstep::ShardingOptions().strategy(strategy);
  if constexpr (std::is_same_v<M, lockstep::examples::VisionTransformer> || std::is_same_v<M, lockstep::examples::Gpt>) {
    std::vector<std::string> blocks;
    for (int64_t i = 0; i < net->depth; ++i) {
      blocks.push_back("blocks." + std::to_string(i)); // each block a unit, as lockstep-train --model vit or gpt
    }
    options.units(blocks);
  }
  if (mode == "fullshard-bf16") {
    options.param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat);
  }
  if (mode == "fullshard-deterministic") { // one micro-batch per rank, as "deterministic"
    options.deterministic(true).micro_batches(group.size());
  }
  return std::make_shared<lockstep::FullyShardedDataParallel<M>>(net, group, options);
}

template <typename M>
std::shared_ptr<lockstep::DistributedDataParallel<M>> replicate(M net, const lockstep::ProcessGroup& group,
                                                                const std::string& mode, const BenchOptions& bench) {
  auto options = lockstep::DistributedOptions()
                     .gradient_as_bucket_view(mode == "views" || mode == "powersgd-views")
                     .static_graph(mode == "static")
                     .rebuild_buckets(mode != "norebuild")
                     .bucket_cap_mb(bench.bucket_cap_mb);
  if (mode == "deterministic") { // one micro-batch per rank: each rank's work is plain DDP's
    options.deterministic(true).micro_batches(group.size());
  }
  if (mode == "powersgd" || mode == "powersgd-views") {
    options.comm_hook(lockstep::comm_hooks::powersgd(
        lockstep::PowerSGDOptions().rank(bench.powersgd_rank).start_iteration(2)));
  }
  return std::make_shared<lockstep::DistributedDataParallel<M>>(net, group, options);
}

template <typename M>
Wrapped<M> wrap(M net, const lockstep::ProcessGroup& group, const std::string& mode, const BenchOptions& bench) {
  Wrapped<M> wrapped;
  wrapped.forward = [net](const torch::Tensor& in) mutable { return net->forward(in); };
  wrapped.params = net->parameters();
  if (sharded(mode)) {
    auto fsdp = wrapped.fsdp = shard(net, group, mode);
    wrapped.forward = [fsdp](const torch::Tensor& in) { return (*fsdp)(in); };
    wrapped.params = (*fsdp)->parameters();
  } else if (mode != "naive" && mode != "nocomm" && mode != "barrier-mpi") {
    auto ddp = wrapped.ddp = replicate(net, group, mode, bench);
    wrapped.forward = [ddp](const torch::Tensor& in) { return (*ddp)(in); };
  } else if (mode == "naive") {
    for (auto& p : net->parameters()) { // the initial broadcast naive code often forgets
      group.broadcast(p, 0);
    }
  }
  return wrapped;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, const std::vector<torch::Tensor>& params) {
  if (name == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.01).momentum(0.9));
}

// Seconds for `steps` calls of `step` on every rank, after 5 untimed ones.
double time_steps(const std::function<void()>& step, int steps, const lockstep::ProcessGroup& group) {
  for (int i = 0; i < 5; ++i) {
    step();
  }
  group.barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    step();
  }
  group.barrier();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Rank 0's line: MODE MODEL steps_per_s=X rss_mb=R0,R1 base_mb=B0,B1.
void print_result(const lockstep::ProcessGroup& group, const std::string& mode, const std::string& model, int steps,
                  double seconds) {
  auto rss = group.all_gather(torch::tensor({peak_rss_mb()}, torch::kDouble));
  auto base = group.all_gather(torch::tensor({base_rss_mb}, torch::kDouble));
  if (group.rank() == 0) {
    std::printf("%s %s steps_per_s=%.2f rss_mb=", mode.c_str(), model.c_str(), steps / seconds);
    for (size_t r = 0; r < rss.size(); ++r) {
      std::printf("%s%.1f", r ? "," : "", rss[r].item<double>());
    }
    std::printf(" base_mb=");
    for (size_t r = 0; r < base.size(); ++r) {
      std::printf("%s%.1f", r ? "," : "", base[r].item<double>());
    }
    std::printf("\n");
  }
}

template <typename M>
void run(M net, const lockstep::ProcessGroup& group, const std::string& mode, const std::string& model, int steps,
         const BenchOptions& bench) {
  const bool images = model == "cnn" || model == "vit";
  const bool text = model == "gpt";
  const int64_t batch = (bench.batch > 0 ? bench.batch : text ? kGptBatch : images ? 64 : 256) / group.size();
  const int64_t features = model == "mlp" ? 784 : 256;
  auto x = text ? torch::randint(0, 256, {batch, kGptContext}) : images ? torch::randn({batch, 1, 28, 28})
                                                                        : torch::randn({batch, features});
  auto y = text ? torch::randint(0, 256, {batch, kGptContext}) : torch::randint(0, 10, {batch});
  auto wrapped = wrap(net, group, mode, bench);
  const auto loss_of_batch = [&] {
    std::optional<lockstep::AutocastGuard> autocast;
    if (bench.precision == "bf16") {
      autocast.emplace(torch::kCPU, torch::kBFloat16);
    }
    auto logits = wrapped.forward(x).to(torch::kFloat);
    return torch::cross_entropy_loss(logits.flatten(0, -2), y.flatten());
  };
  auto optimizer = make_optimizer(bench.optimizer, wrapped.params);
  std::function<void()> comm_step;
  if (mode == "comm") {
    comm_step = communication_alone((*wrapped.ddp)->buckets(), net->parameters(), group);
  }
  int64_t steps_taken = 0;
  auto step = [&] {
    if (comm_step) {
      comm_step();
      return;
    }
    if (mode == "deterministic" || mode == "fullshard-deterministic") { // Note [The same bits at any world size]
      auto loss_of = [&](int64_t) { return loss_of_batch(); };
      if (wrapped.ddp) {
        (*wrapped.ddp)->backward_micro_batches(steps_taken, loss_of);
      } else {
        (*wrapped.fsdp)->backward_micro_batches(steps_taken, loss_of);
      }
      ++steps_taken;
      lockstep::timeline::Span span("optimizer step");
      optimizer->step();
      return;
    }
    optimizer->zero_grad();
    // Spans of the bench's own, in every mode, so that a mode's timeline
    // compares with nocomm's (whose module records none).
    torch::Tensor loss;
    {
      lockstep::timeline::Span span("step: forward and loss");
      loss = loss_of_batch();
    }
    {
      lockstep::timeline::Span span("step: backward");
      loss.backward();
    }
    if (mode == "naive") {
      for (auto& p : net->parameters()) {
        group.allreduce(p.mutable_grad(), lockstep::ReduceOp::Avg);
      }
    }
    {
      lockstep::timeline::Span span("optimizer step");
      optimizer->step();
    }
    if (mode == "barrier-mpi") {
      group.barrier();
    }
  };
  print_result(group, mode, model, steps, time_steps(step, steps, group));
}

// A group whose collectives do nothing but fill all_gather's results (the
// check that ranks agree reads them): what is left is the handle's, the
// check's and the flight recorder's own cost.
class NoopGroup : public lockstep::GroupImpl {
  struct Done : lockstep::Work {
    void wait() override {}
  };

 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend() const override { return "noop"; }
  std::chrono::milliseconds timeout() const override { return lockstep::kDefaultTimeout; }
  std::shared_ptr<lockstep::Work> allreduce(std::vector<torch::Tensor>&, lockstep::ReduceOp, std::string) override {
    return std::make_shared<Done>();
  }
  std::shared_ptr<lockstep::Work> broadcast(std::vector<torch::Tensor>&, int, std::string) override {
    return std::make_shared<Done>();
  }
  std::shared_ptr<lockstep::Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string) override {
    for (auto& out : outputs) {
      out.copy_(input);
    }
    return std::make_shared<Done>();
  }
  std::shared_ptr<lockstep::Work> barrier(std::string) override {
    return std::make_shared<Done>();
  }
};

// `lockstep-bench-ddp recorder`: nanoseconds per collective through the
// handle, with the flight recorder on and off, alternating, as DDP issues
// them (a bucket's allreduce with its name).
int time_recorder() {
  auto bucket = torch::zeros({1024});
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < 10; ++round) {
    for (int on = 0; on < 2; ++on) {
      ::setenv("LOCKSTEP_TRACE_BUFFER_SIZE", on ? "256" : "0", 1);
      lockstep::ProcessGroup group(std::make_shared<NoopGroup>());
      constexpr int kCalls = 100000;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < kCalls; ++i) {
        group.allreduce_async({bucket}, lockstep::ReduceOp::Sum, "allreduce of bucket 0 (8 parameters, 0.0 MiB)")->wait();
      }
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kCalls;
      best[on] = std::min(best[on], ns);
    }
  }
  std::printf("recorder off: %.0f ns per collective; on: %.0f ns; the recorder's own cost: %.0f ns per collective "
              "(best of 10 rounds of 100000)\n", best[0], best[1], best[1] - best[0]);
  return 0;
}

// `lockstep-bench-ddp collectives [gloo|mpi]`, under a launcher (mpirun for mpi): milliseconds per
// collective on 4 MiB of floats (the gathered or reduced size, as FSDP's
// units and DDP's buckets are counted), median of 30, one after another.
int time_collectives(const std::string& backend, double mib) {
  at::set_num_threads(1);
  auto group = lockstep::init_process_group(lockstep::ProcessGroupOptions().backend(backend));
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(mib * (1 << 20) / 4 / group.size())) * group.size();
  auto whole = torch::ones({n});
  auto shard = torch::ones({n / group.size()});
  std::vector<std::pair<std::string, std::function<void()>>> kinds{
      {"allreduce", [&] { group.allreduce_async({whole}, lockstep::ReduceOp::Sum, "allreduce")->wait(); }},
      {"all_gather", [&] { group.all_gather_into_async(whole, shard, "all_gather")->wait(); }},
      {"reduce_scatter", [&] { group.reduce_scatter_async(shard, whole, lockstep::ReduceOp::Sum, "reduce_scatter")->wait(); }}};
  for (auto& [name, call] : kinds) {
    std::vector<double> ms;
    for (int i = 0; i < 35; ++i) {
      const auto start = std::chrono::steady_clock::now();
      call();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    ms.erase(ms.begin(), ms.begin() + 5);
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    if (group.rank() == 0) {
      // Bus bandwidth, as nccl-tests count it: the bytes each rank sends,
      // 2(p-1)/p n for an allreduce and (p-1)/p n for the others, per second.
      const double p = group.size();
      const double sent = (name == "allreduce" ? 2 : 1) * (p - 1) / p * static_cast<double>(n) * 4;
      std::printf("%s of %g MiB over %s, %d ranks: %.2f ms (median of 30), bus bandwidth %.3f Gb/s\n", name.c_str(),
                  static_cast<double>(n) * 4 / (1 << 20), backend.c_str(), group.size(), ms[ms.size() / 2],
                  sent * 8 / (ms[ms.size() / 2] / 1e3) / 1e9);
    }
  }
  return 0;
}

// A timed run's command line: MODE MODEL STEPS and the options.
struct RunOptions {
  std::string mode;
  std::string model;
  int steps = 0;
  BenchOptions bench;
};

// Parses the command line into `options`; returns -1 to go on, else the exit
// code (0 after --help, 2 for a refused command line).
int parse_options(int argc, char** argv, RunOptions& options) {
  CLI::App app{"lockstep-bench-ddp: one rank of the DDP benchmark (bench/run_ddp_bench.sh starts two per "
               "contender, with torchrun's environment variables)."};
  app.add_option("MODE", options.mode, "lockstep, views (gradient_as_bucket_view), static (static_graph), norebuild (buckets "
                 "kept in registration order), norecorder (flight recorder off), detail (LOCKSTEP_DEBUG=detail), mpi (lockstep over MPI, under mpirun), naive (one allreduce per gradient after backward), nocomm (no communication), barrier-mpi (no communication but a barrier over MPI after each step, under mpirun), deterministic and fullshard-deterministic (one micro-batch per rank), checkpointed and fullshard-checkpointed (vit and gpt: each block a lockstep::checkpoint segment) or the sharded and compressed modes")
      ->required()->check(CLI::IsMember({"lockstep", "views", "static", "norebuild", "norecorder", "detail", "mpi",
                                         "naive", "nocomm", "barrier-mpi", "fullshard", "gradop", "noshard", "fullshard-mpi",
                                         "gradop-mpi", "fullshard-bf16", "powersgd", "powersgd-views", "comm", "deterministic",
                                         "fullshard-deterministic", "checkpointed", "fullshard-checkpointed"}));
  app.add_option("MODEL", options.model, "mlp (784-1024-1024-10), deep (48 x Linear(256, 256)), reversed (deep, registered "
                 "last layer first), wide (8 x Linear(2048, 2048)), cnn (the trainer's, with BatchNorm, batch 64), vit (the "
                 "trainer's --model vit, batch 64) or gpt (the trainer's --model gpt, batch 16 of 128 tokens)")
      ->required()->check(CLI::IsMember({"mlp", "deep", "reversed", "wide", "cnn", "vit", "gpt"}));
  app.add_option("--optimizer", options.bench.optimizer, "sgd (with momentum 0.9) or adam")->check(CLI::IsMember({"sgd", "adam"}));
  app.add_option("--batch", options.bench.batch, "Global batch (default: 256, 64 for cnn and vit, 16 for gpt)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--precision", options.bench.precision, "fp32, or bf16 (forward under autocast to bfloat16)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--bucket-cap-mb", options.bench.bucket_cap_mb, "DDP's bucket_cap_mb")->check(CLI::PositiveNumber);
  app.add_option("--powersgd-rank", options.bench.powersgd_rank, "powersgd: the approximation's rank")->check(CLI::PositiveNumber);
  app.add_option("STEPS", options.steps, "Timed optimizer steps, after 5 untimed ones")->required()->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      return app.exit(e); // --help
    }
    std::fprintf(stderr,
                 "lockstep-bench-ddp: %s\nusage: %s lockstep|views|static|norebuild|norecorder|detail|mpi|naive|nocomm "
                 "mlp|deep|reversed STEPS\n       %s recorder   (the flight recorder's cost per collective)\n",
                 e.what(), argv[0], argv[0]);
    return 2;
  }
  return -1;
}

} // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "recorder") {
    return time_recorder();
  }
  if (argc >= 2 && argc <= 4 && std::string(argv[1]) == "collectives") {
    return time_collectives(argc >= 3 ? argv[2] : "gloo", argc == 4 ? std::atof(argv[3]) : 4);
  }
  RunOptions run_options;
  if (const int exit_code = parse_options(argc, argv, run_options); exit_code >= 0) {
    return exit_code;
  }
  const auto& [mode, model, steps, bench] = run_options;
  try {
    lockstep::examples::require_fast_blas("lockstep-bench-ddp");
    at::set_num_threads(1); // one core per rank, as the Python contender
    // Read when the group is made: Note [Flight recorder] in src/comm/flight_recorder.cpp.
    if (mode == "norecorder") {
      ::setenv("LOCKSTEP_TRACE_BUFFER_SIZE", "0", 1);
    } else if (mode == "detail") {
      ::setenv("LOCKSTEP_DEBUG", "detail", 1);
    }
    auto group = lockstep::init_process_group(lockstep::ProcessGroupOptions().backend(
        mode == "mpi" || mode.find("-mpi") != std::string::npos ? "mpi" : "gloo"));
    torch::manual_seed(0);
    base_rss_mb = peak_rss_mb();
    if (model == "reversed") {
      run(ReversedDeep(), group, mode, model, steps, bench);
    } else if (model == "cnn") {
      run(lockstep::examples::ConvNet(), group, mode, model, steps, bench);
    } else if (model == "vit") {
      run(lockstep::examples::VisionTransformer(64, 4, 4, 0.1, checkpointed(mode)), group, mode, model, steps, bench);
    } else if (model == "gpt") {
      run(lockstep::examples::Gpt(256, kGptContext, 128, 4, 4, 0.1, checkpointed(mode)), group, mode, model, steps,
          bench);
    } else {
      run(make_model(model), group, mode, model, steps, bench);
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
