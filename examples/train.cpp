// lockstep-train: trains a small convolutional classifier on Fashion-MNIST
// (or any MNIST-format data) with DistributedDataParallel under lockstep-run
// or torchrun, one process per rank, or else with lockstep::DataParallel on
// CPU replicas (or GPUs when there are some). It evaluates on the whole test
// set, split over the ranks, after every epoch, and leaves its metrics, model,
// checkpoint and curves in one output folder.
//
//   lockstep-run --nproc-per-node 2 lockstep-train   # Debian's Fashion-MNIST, 2 ranks
//   lockstep-train --data DIR                        # MNIST-format IDX files, gzipped or not, DataParallel
//   lockstep-train --synthetic                       # generated data, deterministic by --seed
//   lockstep-train --help
//
// main() reads top to bottom: options, process settings, data, the setup
// (distributed_setup or data_parallel_setup: the wrapped model, this rank's
// batches, and the checkpoint it resumes from), then train(), which runs the
// epochs (train_epoch, train_step, evaluate) and reports.

#include "blas_check.h"
#include "checkpoint.h"
#include "data.h"
#include "metrics.h"
#include "models.h"
#include "options.h"
#include "progress.h"
#include "sampling.h"

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using lockstep::examples::BatchPlan;
using lockstep::examples::Config;
using lockstep::examples::ConvNet;
using lockstep::examples::DataSignature;
using lockstep::examples::Dataset;
using lockstep::examples::DataOptions;
using lockstep::examples::Samples;
using lockstep::examples::Tally;
using lockstep::examples::TrainingState;

// ---------------------------------------------------------------------------
// Process settings
// ---------------------------------------------------------------------------

// Settings of the whole process, made before any tensor: a fast BLAS, a heap
// that keeps freed memory, and the intra-op thread count.
void prepare_process(int threads) {
  lockstep::examples::require_fast_blas("lockstep-train");
  // Keep freed memory in the heap instead of returning every large tensor
  // to the kernel: fresh pages fault and are zeroed on each step otherwise,
  // which cost 25% of a CNN step on CPU here (docs/performance.md).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // --threads, else OMP_NUM_THREADS (lockstep-run gives each rank its
  // share), else every core: libtorch's own default can be lower (it asks
  // cpuinfo for physical cores, which fails on some virtual machines).
  const char* omp = std::getenv("OMP_NUM_THREADS");
  at::set_num_threads(threads > 0                            ? threads
                      : omp != nullptr && std::atoi(omp) > 0 ? std::atoi(omp)
                                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

// ---------------------------------------------------------------------------
// Output folder and checkpoint paths
// ---------------------------------------------------------------------------

// runs/<id>: the launcher's run id, the same for every attempt of a job, so
// that a restarted job finds its checkpoint; else the time.
std::string default_out_dir() {
  for (const char* name : {"LOCKSTEP_RUN_ID", "TORCHELASTIC_RUN_ID"}) {
    const char* id = std::getenv(name);
    if (id != nullptr && *id != '\0' && std::string(id) != "none") {
      return std::string("runs/") + id;
    }
  }
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", std::localtime(&now));
  return std::string("runs/") + text;
}

// Creates `dir` (and its parents); "" if that worked, else why not.
std::string make_dir(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error || ::access(dir.c_str(), W_OK) != 0) {
    return "lockstep-train: cannot create or write the output folder " + dir + " (" +
           (error ? error.message() : std::string(std::strerror(errno))) + "); pick another with --out.";
  }
  return "";
}

// Rank 0's output folder, created by rank 0, for every rank: the ranks must
// read the same checkpoint. Every rank fails if rank 0 could not create it.
// Where the group's collectives take their tensors, and so where this rank
// trains: NCCL reduces CUDA tensors only, one GPU per rank.
torch::Device group_device(const lockstep::ProcessGroup& group) {
  if (group.backend() != "nccl") {
    return torch::kCPU;
  }
  const char* local = std::getenv("LOCAL_RANK");
  const int64_t index = local != nullptr ? std::atoll(local) : group.rank();
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index % std::max<int64_t>(1, torch::cuda::device_count())));
}

std::string agree_on_out_dir(const lockstep::ProcessGroup& group, const std::string& mine) {
  constexpr int64_t kMaxLength = 4096;
  std::string error = group.rank() == 0 ? make_dir(mine) : "";
  auto message = torch::zeros({kMaxLength + 1}, torch::kInt64);
  if (group.rank() == 0) {
    const std::string& sent = error.empty() ? mine : error;
    TORCH_CHECK(static_cast<int64_t>(sent.size()) <= kMaxLength, "lockstep-train: --out ", mine, " is too long.");
    message[0] = error.empty() ? 1 : -1;
    for (size_t i = 0; i < sent.size(); ++i) {
      message[static_cast<int64_t>(i) + 1] = static_cast<int64_t>(static_cast<unsigned char>(sent[i]));
    }
  }
  message = message.to(group_device(group));
  group.broadcast(message, 0);
  message = message.cpu();
  std::string text;
  auto m = message.accessor<int64_t, 1>();
  for (int64_t i = 1; i <= kMaxLength && m[i] != 0; ++i) {
    text += static_cast<char>(m[i]);
  }
  TORCH_CHECK(m[0] == 1, group.rank() == 0 ? text : "lockstep-train: rank 0 could not create the output folder: " + text);
  return text;
}

// What this run trains on, for its checkpoints: a resume over other data is
// said (resume_differences).
DataSignature data_signature(const Samples& train, uint64_t seed) {
  auto crc = [](const torch::Tensor& t) {
    const auto bytes = t.contiguous();
    return lockstep::examples::checkpoint_crc(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
  };
  return DataSignature{train.images.size(0), uint64_t{crc(train.images)} << 32 | crc(train.labels), seed};
}

// The checkpoint and the saved model go into the output folder unless
// --checkpoint and --save name other files.
void complete_paths(Config& config) {
  if (config.checkpoint_path.empty()) {
    config.checkpoint_path = config.out_dir + "/checkpoint.ckpt";
  }
  if (config.save_path.empty()) {
    config.save_path = config.out_dir + "/model.pt";
  }
}

// ---------------------------------------------------------------------------
// Resuming
// ---------------------------------------------------------------------------

// What differs between the run that wrote a checkpoint and this one, in
// words ("" if nothing): each changes the data order from here on.
std::string resume_differences(const TrainingState& there, const BatchPlan& here, const DataSignature& data) {
  std::string said;
  if (there.world_size != here.world_size) {
    said += "; written over " + std::to_string(there.world_size) + " rank(s): the data order goes on unchanged";
  }
  if (there.batch_size != 0 && there.batch_size != here.batch_size) { // format 2 kept no batch size
    said += "; written with --batch-size " + std::to_string(there.batch_size) + ": the rest of the epoch goes on in "
            "batches of " + std::to_string(here.batch_size);
  }
  if (there.data.rows == 0) { // format 2 kept no signature
    return said;
  }
  if (there.data.rows != data.rows || there.data.checksum != data.checksum) {
    said += "; written over other training data (" + std::to_string(there.data.rows) + " samples of another content, "
            "seed " + std::to_string(there.data.seed) + "; here " + std::to_string(data.rows) + ", seed " +
            std::to_string(data.seed) + ": another --data, --train-samples, or --seed with --synthetic), so the rest "
            "of the run trains on this data";
  } else if (there.data.seed != data.seed) {
    said += "; written with --seed " + std::to_string(there.data.seed) + ", so the data order differs from here on";
  }
  return said;
}

// `state` as this run writes it into its checkpoints.
TrainingState this_run(TrainingState state, const BatchPlan& plan, const DataSignature& data) {
  state.world_size = plan.world_size;
  state.batch_size = plan.batch_size;
  state.data = data;
  return state;
}

// Where training starts: the checkpoint's position when there is one (loaded
// into `net` and `optimizer`), else the beginning.
TrainingState resume(
    const Config& config,
    ConvNet& net,
    torch::optim::Optimizer& optimizer,
    const BatchPlan& plan,
    const DataSignature& data,
    bool report) {
  TrainingState state;
  if (config.checkpoint_path.empty() || !lockstep::examples::load_checkpoint(config.checkpoint_path, *net, optimizer, state)) {
    return this_run(state, plan, data);
  }
  if (report) {
    std::fprintf(stderr, "lockstep-train: resumed from %s at step %lld (epoch %lld, sample %lld of %lld)%s\n",
                 config.checkpoint_path.c_str(), static_cast<long long>(state.step), static_cast<long long>(state.epoch + 1),
                 static_cast<long long>(state.samples_in_epoch),
                 static_cast<long long>(lockstep::examples::epoch_extent(plan).first),
                 resume_differences(state, plan, data).c_str());
  }
  return this_run(state, plan, data);
}

// Every rank must resume from the same state, or the ranks would train on
// different data positions (DDP broadcasts rank 0's parameters, which hides a
// different model but not a different position). Each rank shares what it
// resumed from; all fail together, naming the ranks, if they differ.
void check_ranks_resumed_alike(
    const lockstep::ProcessGroup& group,
    const Config& config,
    const TrainingState& state,
    bool resumed,
    torch::nn::Module& net,
    torch::optim::Optimizer& optimizer) {
  using namespace lockstep::examples;
  auto mine = torch::cat({torch::tensor({static_cast<int64_t>(resumed), state.step, state.epoch, state.samples_in_epoch}),
                          hash_tensor(content_hash(model_tensors(net))).reshape({1}),
                          hash_tensor(optimizer_hash(optimizer)).reshape({1})});
  auto all = group.all_gather(mine.to(group_device(group)));
  for (auto& t : all) {
    t = t.cpu();
  }
  auto describe = [&](int r) {
    auto v = all[r].accessor<int64_t, 1>();
    return v[0] == 0 ? std::string("started from scratch (no checkpoint found)")
                     : "resumed at step " + std::to_string(v[1]) + " (epoch " + std::to_string(v[2] + 1) + ", sample " +
                         std::to_string(v[3]) + ")";
  };
  for (int r = 1; r < group.size(); ++r) {
    const bool same_position = torch::equal(all[r].narrow(0, 0, 4), all[0].narrow(0, 0, 4));
    const bool same_state = all[0][0].item<int64_t>() == 0 || torch::equal(all[r], all[0]);
    TORCH_CHECK(same_position && same_state, "lockstep-train: rank ", r, " ", describe(r),
                same_position ? " with a different model or optimizer state" : "", " but rank 0 ", describe(0),
                ". Every rank must read the same checkpoint: on several machines, put --checkpoint on storage every "
                "node shares, or copy rank 0's file to each node (this rank's --checkpoint is ", config.checkpoint_path,
                ").");
  }
}

// ---------------------------------------------------------------------------
// The setup: DistributedDataParallel or DataParallel
// ---------------------------------------------------------------------------

// How this process trains, as the training loop needs it: one rank of
// DistributedDataParallel, or DataParallel in one process.
struct Setup {
  int rank = 0;
  int world_size = 1;
  std::string description; // "DistributedDataParallel over 2 ranks (gloo)"
  // The wrapped model's forward.
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  // The batches of each epoch, and this rank's share (Note [Data order]).
  BatchPlan plan;
  // Sums every rank's tally (a tiny allreduce under DDP; as is with one process).
  std::function<Tally(const Tally&)> combine;
  // Gives every rank rank 0's buffers (BatchNorm's running statistics).
  std::function<void()> sync_buffers;
  // Where training starts: the checkpoint's position, or the beginning.
  TrainingState state;
  // Where the model and each batch live: a GPU under NCCL or DataParallel on GPUs.
  torch::Device device = torch::kCPU;
};

// One rank of DistributedDataParallel, under lockstep-run or torchrun: the
// ranks agree on rank 0's output folder and resume alike, then each reads
// its share of each global batch (Note [Data order]).
Setup distributed_setup(
    ConvNet& net,
    torch::optim::Optimizer& optimizer,
    const Dataset& data,
    const DataSignature& signature,
    Config& config) {
  auto group = lockstep::init_process_group(
      lockstep::ProcessGroupOptions().timeout(std::chrono::seconds(config.timeout_seconds))); // 0: LOCKSTEP_TIMEOUT
  TORCH_CHECK(config.batch_size % group.size() == 0, "lockstep-train: --batch-size ", config.batch_size,
              " does not split evenly over ", group.size(), " ranks; pick a multiple of ", group.size(),
              " (each rank takes batch-size / ranks rows).");
  config.out_dir = agree_on_out_dir(group, config.out_dir);
  complete_paths(config);
  Setup setup;
  setup.rank = group.rank();
  setup.world_size = group.size();
  setup.device = group_device(group);
  net->to(setup.device); // in place: the optimizer keeps its parameters
  setup.plan = BatchPlan{data.train.images.size(0), config.batch_size, group.size(), group.rank(), config.seed};
  setup.state = resume(config, net, optimizer, setup.plan, signature, group.rank() == 0);
  check_ranks_resumed_alike(group, config, setup.state, setup.state.step > 0 || setup.state.epoch > 0, *net, optimizer);
  lockstep::DistributedDataParallel<ConvNet> model(net, group);
  setup.forward = [model](const torch::Tensor& x) mutable { return model(x); };
  const int64_t per_rank = config.batch_size / group.size();
  setup.description = "DistributedDataParallel over " + std::to_string(group.size()) + " ranks (" + group.backend() + ")";
  // Loss and accuracy sums as doubles: exact for any count below 2^53.
  setup.combine = [group, device = setup.device](const Tally& mine) {
    auto sums = torch::tensor({mine.loss_sum, static_cast<double>(mine.correct), static_cast<double>(mine.rows)},
                              torch::kFloat64).to(device);
    group.allreduce(sums);
    sums = sums.cpu();
    auto s = sums.accessor<double, 1>();
    return Tally{s[0], static_cast<int64_t>(s[1]), static_cast<int64_t>(s[2])};
  };
  setup.sync_buffers = [group, net] {
    for (auto& buffer : net->buffers()) {
      group.broadcast(buffer, 0);
    }
  };
  if (group.rank() == 0) {
    std::fprintf(stderr, "lockstep-train: %s, %lld train / %lld test samples, %s, batch %lld (%lld per rank), "
                 "outputs in %s/\n", data.source.c_str(), static_cast<long long>(data.train.images.size(0)),
                 static_cast<long long>(data.test.images.size(0)), setup.description.c_str(),
                 static_cast<long long>(config.batch_size), static_cast<long long>(per_rank), config.out_dir.c_str());
  }
  return setup;
}

// One process with DataParallel on --replicas CPU replicas (0: lockstep's
// default devices), reading the global batches (Note [Data order]).
Setup data_parallel_setup(
    ConvNet& net,
    torch::optim::Optimizer& optimizer,
    const Dataset& data,
    const DataSignature& signature,
    Config& config) {
  const std::string error = make_dir(config.out_dir);
  TORCH_CHECK(error.empty(), error);
  complete_paths(config);
  Setup setup;
  auto options = lockstep::DataParallelOptions();
  if (config.replicas > 0) {
    options.devices(std::vector<torch::Device>(config.replicas, torch::Device(torch::kCPU)));
  } else {
    setup.device = lockstep::default_devices()[0]; // the first GPU, where DataParallel wants the module
    net->to(setup.device);
  }
  setup.plan = BatchPlan{data.train.images.size(0), config.batch_size, 1, 0, config.seed};
  setup.state = resume(config, net, optimizer, setup.plan, signature, true);
  lockstep::DataParallel<ConvNet> model(net, options);
  setup.forward = [model](const torch::Tensor& x) mutable { return model(x); };
  const int64_t n = data.train.images.size(0);
  std::string devices;
  for (const auto& d : model->devices()) {
    devices += (devices.empty() ? "" : ",") + d.str();
  }
  setup.description = "DataParallel on [" + devices + "]";
  setup.combine = [](const Tally& mine) { return mine; };
  setup.sync_buffers = [] {};
  std::fprintf(stderr, "lockstep-train: %s, %lld train / %lld test samples, %s, batch %lld, outputs in %s/\n",
               data.source.c_str(), static_cast<long long>(n), static_cast<long long>(data.test.images.size(0)),
               setup.description.c_str(), static_cast<long long>(config.batch_size), config.out_dir.c_str());
  return setup;
}

// ---------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------

// What the training loop works on.
struct Run {
  ConvNet& net; // the bare model: evaluated, checkpointed and saved
  torch::optim::SGD& optimizer;
  const Dataset& data;
  const Setup& setup;
  const Config& config;
};

// What the summary reports of this attempt.
struct Totals {
  double train_seconds = 0; // without the evaluations
  int64_t samples = 0;      // trained in this attempt, over every rank
  Tally last_epoch;         // the last epoch's training figures
  Tally tested;             // the last evaluation
};

double rate(double rows, double seconds) {
  return seconds > 0 ? rows / seconds : 0;
}

std::string percent(const Tally& t) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * t.correct / std::max<int64_t>(1, t.rows));
  return text;
}

double mean_loss(const Tally& t) {
  return t.loss_sum / std::max<int64_t>(1, t.rows);
}

double accuracy(const Tally& t) {
  return static_cast<double>(t.correct) / std::max<int64_t>(1, t.rows);
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Equal hashes mean bitwise-equal models (the restart tests compare them).
uint64_t parameter_hash(torch::nn::Module& module) {
  return lockstep::examples::content_hash(lockstep::examples::model_tensors(module));
}

// The learning rate of optimizer step `step` (from 0) of `total`: a linear
// warmup, then constant, divided by `gamma` every `step_epochs` epochs, or a
// cosine down to 0. A function of the step alone, so a resumed run follows
// the same schedule.
double lr_at(const Config& c, int64_t step, int64_t steps_per_epoch, int64_t total) {
  if (step < c.warmup_steps) {
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  if (c.schedule == "step") {
    return c.lr * std::pow(c.gamma, static_cast<double>(step / std::max<int64_t>(1, steps_per_epoch) / c.step_epochs));
  }
  if (c.schedule == "cosine") {
    const double progress = static_cast<double>(step - c.warmup_steps) / std::max<int64_t>(1, total - c.warmup_steps);
    return c.lr * 0.5 * (1 + std::cos(M_PI * std::min(1.0, progress)));
  }
  return c.lr;
}

// LOCKSTEP_FAULT=RANK:STEP[:CODE]: see --help.
void maybe_inject_fault(int rank, int64_t step) {
  static const char* spec = std::getenv("LOCKSTEP_FAULT");
  if (spec == nullptr) {
    return;
  }
  // The first attempt only, under lockstep-run or torchrun.
  for (const char* name : {"LOCKSTEP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    const char* restarts = std::getenv(name);
    if (restarts != nullptr && std::atoi(restarts) != 0) {
      return;
    }
  }
  int fault_rank = -1;
  long long fault_step = -1;
  char code[16] = "3";
  const int fields = std::sscanf(spec, "%d:%lld:%15s", &fault_rank, &fault_step, code);
  TORCH_CHECK(fields >= 2, "lockstep-train: LOCKSTEP_FAULT=\"", spec, "\" is malformed; expected RANK:STEP[:CODE], e.g. 1:30 or 1:30:kill.");
  if (fault_rank != rank || fault_step != step) {
    return;
  }
  std::fprintf(stderr, "lockstep-train: LOCKSTEP_FAULT: rank %d stops at step %lld (%s)\n", rank, fault_step,
               std::strcmp(code, "kill") == 0 ? "SIGKILL" : code);
  std::fflush(stderr);
  if (std::strcmp(code, "kill") == 0) {
    std::raise(SIGKILL);
  }
  if (std::strcmp(code, "hang") == 0) {
    // A stalled rank: deaf to SIGTERM, only SIGKILL ends it.
    std::signal(SIGTERM, SIG_IGN);
    while (true) {
      ::pause();
    }
  }
  std::_Exit(std::atoi(code));
}

// Test loss (summed) and right answers over the whole test set: each rank
// takes its share of the rows, and the shares are added up. Rank 0's buffers
// are given to every rank first, so that every share is judged by the model
// rank 0 saves.
Tally evaluate(const Run& run) {
  run.setup.sync_buffers();
  torch::NoGradGuard no_grad;
  run.net->eval();
  const Samples& test = run.data.test;
  const int64_t n = test.images.size(0);
  const int64_t begin = n * run.setup.rank / run.setup.world_size;
  const int64_t end = n * (run.setup.rank + 1) / run.setup.world_size;
  Tally mine;
  constexpr int64_t kBatch = 500;
  for (int64_t i = begin; i < end; i += kBatch) {
    const int64_t rows = std::min(kBatch, end - i);
    auto logits = run.net(test.images.narrow(0, i, rows).to(run.setup.device));
    auto labels = test.labels.narrow(0, i, rows).to(run.setup.device);
    mine += Tally{torch::cross_entropy_loss(logits, labels, {}, at::Reduction::Sum).item<double>(),
                  logits.argmax(1).eq(labels).sum().item<int64_t>(), rows};
  }
  run.net->train();
  return run.setup.combine(mine);
}

// One optimizer step on the training rows `index` at learning rate `lr`;
// returns this rank's tally of the batch.
Tally train_step(const Run& run, const torch::Tensor& index, double lr) {
  auto x = run.data.train.images.index_select(0, index).to(run.setup.device);
  auto y = run.data.train.labels.index_select(0, index).to(run.setup.device);
  for (auto& group : run.optimizer.param_groups()) {
    static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
  }
  run.optimizer.zero_grad();
  auto logits = run.setup.forward(x);
  auto loss = torch::cross_entropy_loss(logits, y);
  loss.backward();
  {
    lockstep::timeline::Span span("optimizer step");
    run.optimizer.step();
  }
  const int64_t b = index.size(0);
  return Tally{loss.item<double>() * b, logits.argmax(1).eq(y).sum().item<int64_t>(), b};
}

// Rank 0 writes where training stands; every rank has the same state.
void checkpoint(const Run& run, const TrainingState& state) {
  if (run.setup.rank == 0 && !run.config.checkpoint_path.empty()) {
    lockstep::examples::save_checkpoint(run.config.checkpoint_path, *run.net, run.optimizer, state);
  }
}

// The epoch's line (rank 0) and record: its training figures over every rank,
// `totals.tested`, and its speed over the rows trained in this attempt.
void report_epoch(const Run& run, const TrainingState& state, lockstep::examples::MetricsLog& metrics,
                  const Totals& totals, double train_seconds, double seconds, double lr, int64_t resumed_rows) {
  const Tally& done = totals.last_epoch;
  const Tally& tested = totals.tested;
  if (run.setup.rank == 0) {
    std::printf("lockstep-train: epoch %lld/%d: train loss %.4f, train accuracy %s, test loss %.4f, test accuracy "
                "%s, %.1f s\n",
                static_cast<long long>(state.epoch + 1), run.config.epochs, mean_loss(done), percent(done).c_str(),
                mean_loss(tested), percent(tested).c_str(), seconds);
    std::fflush(stdout);
  }
  metrics.write({{"kind", "epoch"}, {"epoch", state.epoch + 1}, {"step", state.step}, {"epochs_done", state.epoch + 1},
                 {"lr", lr}, {"train_loss", mean_loss(done)}, {"train_accuracy", accuracy(done)},
                 {"samples", done.rows}, {"test_loss", mean_loss(tested)}, {"test_accuracy", accuracy(tested)},
                 {"seconds", seconds}, {"samples_per_second", rate(done.rows - resumed_rows, train_seconds)}});
}

// --eval-every: an evaluation in the middle of an epoch, recorded and said
// by rank 0; returns its seconds.
double evaluate_mid_epoch(const Run& run, const TrainingState& state, double epochs_done,
                          lockstep::examples::MetricsLog& metrics) {
  const auto eval_start = Clock::now();
  const Tally t = evaluate(run);
  metrics.write({{"kind", "eval"}, {"epoch", state.epoch + 1}, {"step", state.step}, {"epochs_done", epochs_done},
                 {"test_loss", mean_loss(t)}, {"test_accuracy", accuracy(t)}});
  if (run.setup.rank == 0) {
    std::fprintf(stderr, "%slockstep-train: step %lld: test loss %.4f, test accuracy %s\n",
                 isatty(fileno(stderr)) ? "\n" : "", static_cast<long long>(state.step), mean_loss(t),
                 percent(t).c_str()); // below the progress bar's line on a terminal
  }
  return seconds_since(eval_start);
}

// Trains the rest of epoch `state.epoch` (all of it unless resumed mid-epoch),
// evaluates, reports the epoch and checkpoints; `state` then stands at the
// next epoch.
void train_epoch(const Run& run, TrainingState& state, lockstep::examples::MetricsLog& metrics, Totals& totals) {
  const Config& config = run.config;
  const auto epoch_start = Clock::now();
  const BatchPlan& plan = run.setup.plan;
  const auto [epoch_rows, batch_count] = lockstep::examples::epoch_extent(plan);
  const auto batches = lockstep::examples::rank_batches(plan, state.epoch, state.samples_in_epoch);
  const int64_t total_steps = batch_count * config.epochs;
  // Every rank folds its batches into the epoch's tally at the same steps:
  // about 50 times an epoch, every --log-every steps, at checkpoints, and
  // at the epoch's end.
  const int64_t fold_every = std::max<int64_t>(1, batch_count / 50);
  Tally& done = state.epoch_tally; // every rank's rows up to the last fold (restored when resumed)
  Tally pending;                   // this rank's rows since
  const int64_t resumed_rows = done.rows;
  lockstep::examples::Progress progress(epoch_rows, resumed_rows, static_cast<int>(state.epoch + 1), config.epochs,
                                        run.setup.rank == 0);
  double eval_seconds = 0;
  Tally logged = done; // the tally at the last training record
  auto logged_at = Clock::now();
  for (size_t i = 0; i < batches.size(); ++i) {
    maybe_inject_fault(run.setup.rank, state.step);
    const double lr = lr_at(config, state.step, batch_count, total_steps);
    pending += train_step(run, batches[i], lr);
    ++state.step;
    state.samples_in_epoch += batches[i].size(0) * plan.world_size; // every rank takes as many rows
    const double epochs_done = state.epoch + static_cast<double>(state.samples_in_epoch) / epoch_rows;
    const bool last = i + 1 == batches.size();
    const bool save = state.step % config.checkpoint_every == 0 && !last; // the epoch's end saves anyway
    const bool log = state.step % config.log_every == 0;
    if (save || log || last || state.step % fold_every == 0) {
      done += run.setup.combine(pending);
      pending = Tally{};
      progress.update(done.rows, mean_loss(done), accuracy(done));
    }
    if (log) {
      // The steps since the last record: loss, accuracy and speed over every rank.
      const Tally recent{done.loss_sum - logged.loss_sum, done.correct - logged.correct, done.rows - logged.rows};
      metrics.write({{"kind", "train"}, {"epoch", state.epoch + 1}, {"step", state.step}, {"epochs_done", epochs_done},
                     {"lr", lr}, {"loss", mean_loss(recent)}, {"accuracy", accuracy(recent)},
                     {"samples_per_second", rate(recent.rows, seconds_since(logged_at))}});
      logged = done;
      logged_at = Clock::now();
    }
    if (config.eval_every > 0 && state.step % config.eval_every == 0 && !last) {
      eval_seconds += evaluate_mid_epoch(run, state, epochs_done, metrics);
      logged_at = Clock::now(); // not a training step's time
    }
    if (save) {
      checkpoint(run, state);
    }
  }
  TORCH_CHECK(done.rows > 0, "lockstep-train: epoch ", state.epoch + 1, " has no training batch (",
              run.data.train.images.size(0), " training samples); give more samples.");
  totals.train_seconds += seconds_since(epoch_start) - eval_seconds;
  totals.samples += done.rows - resumed_rows;
  totals.last_epoch = done;
  totals.tested = evaluate(run);
  report_epoch(run, state, metrics, totals, seconds_since(epoch_start) - eval_seconds, seconds_since(epoch_start),
               lr_at(config, state.step - 1, batch_count, total_steps), resumed_rows);
  ++state.epoch;
  state.samples_in_epoch = 0;
  state.epoch_tally = Tally{};
  checkpoint(run, state); // every epoch, besides every --checkpoint-every steps
}

// A checkpoint of a run that trained every epoch: evaluated again (on every
// rank), and said so by rank 0.
void report_finished_run(const Run& run, const TrainingState& state) {
  const Tally tested = evaluate(run);
  if (run.setup.rank != 0) {
    return;
  }
  std::printf("lockstep-train: nothing to train: the checkpoint %s is of a finished run (%lld of %d epoch(s), %lld "
              "steps); raise --epochs to train on, or point --checkpoint elsewhere to start afresh.\n",
              run.config.checkpoint_path.c_str(), static_cast<long long>(state.epoch), run.config.epochs,
              static_cast<long long>(state.step));
  std::printf("lockstep-train: test accuracy %s of the checkpoint's model\n", percent(tested).c_str());
  std::printf("lockstep-train: final parameters fnv1a64=%016llx\n", static_cast<unsigned long long>(parameter_hash(*run.net)));
}

// Rank 0's last words: saves the model, draws the curves, and prints the
// summary and the list of outputs.
void report_summary(const Run& run, const TrainingState& state, const Totals& totals, double seconds) {
  const Config& config = run.config;
  const int world_size = run.setup.world_size;
  std::vector<std::string> outputs{"metrics.jsonl"};
  if (!config.save_path.empty()) {
    torch::save(run.net, config.save_path);
    outputs.push_back(config.save_path);
  }
  if (!config.checkpoint_path.empty()) {
    outputs.push_back(config.checkpoint_path);
  }
  const std::string no_curves = lockstep::examples::plot_curves(config.out_dir);
  if (no_curves.empty()) {
    outputs.push_back("curves.png");
  }
  const double samples_per_second = rate(totals.samples, totals.train_seconds);
  std::printf("lockstep-train: %d epoch(s), %lld steps in %.1f s (%.1f s training) with %s; %.0f samples/s over all "
              "%d rank(s), %.0f per rank\n",
              config.epochs, static_cast<long long>(state.step), seconds, totals.train_seconds,
              run.setup.description.c_str(), samples_per_second, world_size, samples_per_second / world_size);
  const Tally& last = totals.last_epoch;
  const Tally& tested = totals.tested;
  std::printf("lockstep-train: last epoch: train loss %.4f, train accuracy %s; test loss %.4f, test accuracy %s "
              "(%lld of %lld test images, over %d rank(s))\n",
              mean_loss(last), percent(last).c_str(), mean_loss(tested), percent(tested).c_str(),
              static_cast<long long>(tested.correct), static_cast<long long>(tested.rows), world_size);
  std::printf("lockstep-train: final parameters fnv1a64=%016llx\n", static_cast<unsigned long long>(parameter_hash(*run.net)));
  std::string listed;
  for (const auto& o : outputs) {
    const bool inside = o.rfind(config.out_dir + "/", 0) == 0;
    listed += (listed.empty() ? "" : ", ") + (inside ? o.substr(config.out_dir.size() + 1) : o);
  }
  std::printf("lockstep-train: outputs in %s/: %s\n", config.out_dir.c_str(), listed.c_str());
  if (!no_curves.empty()) {
    std::printf("lockstep-train: %s\n", no_curves.c_str());
  }
}

// Trains from where the setup starts to the last epoch, then reports.
void train(const Run& run) {
  const bool lead = run.setup.rank == 0;
  TrainingState state = run.setup.state;
  lockstep::examples::MetricsLog metrics;
  if (lead) {
    // Only rank 0 writes checkpoints, and only its machine can tell whether
    // a temporary file's writer (a pid) is gone: on a disk shared by several
    // nodes, another node's rank would remove a save in progress.
    lockstep::examples::remove_stale_temporaries(run.config.checkpoint_path);
    metrics = lockstep::examples::MetricsLog(run.config.out_dir + "/metrics.jsonl", state.step);
  }
  if (state.epoch >= run.config.epochs) {
    report_finished_run(run, state);
    return;
  }
  const auto start = Clock::now();
  Totals totals;
  while (state.epoch < run.config.epochs) {
    train_epoch(run, state, metrics, totals);
  }
  const double seconds = seconds_since(start);
  if (lead) {
    report_summary(run, state, totals, seconds);
  }
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-train: trains a small CNN classifier on Fashion-MNIST (or any MNIST-format data): with "
               "DistributedDataParallel under lockstep-run or torchrun, else with DataParallel on CPU replicas. "
               "Evaluates on the whole test set after each epoch, and writes metrics.jsonl, the model, a checkpoint "
               "and curves.png into --out."};
  DataOptions data_options;
  Config config;
  std::string export_dir;
  const int exit_code = lockstep::examples::parse_command_line(app, argc, argv, data_options, config, export_dir);
  if (exit_code >= 0) {
    return exit_code; // --help, or a refusal
  }
  try {
    prepare_process(config.threads);
    if (!export_dir.empty()) {
      lockstep::examples::export_synthetic(export_dir, config.seed);
      std::printf("lockstep-train: wrote the synthetic dataset (seed %llu) as MNIST IDX files in %s\n",
                  static_cast<unsigned long long>(config.seed), export_dir.c_str());
      return 0;
    }
    const Dataset data = lockstep::examples::load_dataset(data_options, config.seed);
    const DataSignature signature = data_signature(data.train, config.seed);

    torch::manual_seed(config.seed);
    ConvNet net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(config.lr).momentum(config.momentum));
    if (config.out_dir.empty()) {
      config.out_dir = default_out_dir();
    }
    // Under a launcher (lockstep-run, torchrun, mpirun, srun), one process per rank with
    // DistributedDataParallel; otherwise one process with DataParallel.
    const Setup setup = lockstep::launched_by_launcher() ? distributed_setup(net, optimizer, data, signature, config)
                                                         : data_parallel_setup(net, optimizer, data, signature, config);
    train(Run{net, optimizer, data, setup, config});
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace()); // already says who raised it
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-train: %s\n", e.what());
    return 1;
  }
  return 0;
}
