#pragma once

// lockstep-train's command line: its flags, their bounds, and the checks of
// the paths and counts they name, made before anything is loaded or trained.
// A refusal is a UsageError, which main() prints as both tools do (common::
// kUsageError).

#include "text_data.h"

#include <common/cli_checks.h>
#include <lockstep/version.h>

#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

// What the command line sets besides the data, with its defaults.
struct Config {
  int epochs = 3;
  int64_t batch_size = 128;
  double lr = 0.1;                 // --optimizer sgd's default; adamw's is kAdamWLr
  double momentum = 0.9;
  std::string optimizer;           // sgd or adamw; "" until parsed: sgd for the CNN, adamw for the transformers
  std::string schedule = "cosine"; // constant, step or cosine
  int64_t warmup_steps = 100;
  int step_epochs = 1;
  double gamma = 0.5;
  uint64_t seed = 1;
  int threads = 0;
  int replicas = 2;
  std::string out_dir;
  std::string save_path;
  std::string checkpoint_path;
  std::string init_from;
  int64_t checkpoint_every = 500;
  int64_t eval_every = 0;
  int64_t log_every = 50;
  int timeout_seconds = 0;
  std::string sharding; // "": DistributedDataParallel; full, grad-op or none: FullyShardedDataParallel
  std::string precision = "fp32"; // fp32; bf16: autocast; fp16: autocast and a GradScaler
  int64_t growth_interval = 2000;  // fp16: the GradScaler's growth_interval
  std::string comm_hook = "none";  // DDP's bucket reduction: none, fp16, bf16 or powersgd
  int64_t powersgd_rank = 4;
  int64_t powersgd_start = 10;     // plain allreduce for this many steps first
  int64_t micro_batch_size = 0;    // --deterministic: samples per micro-batch
  bool deterministic = false;      // DDP's deterministic mode: the same bits at any world size
  std::string model = "cnn";       // cnn, vit or gpt (models.h)
  bool activation_checkpointing = false; // --model vit or gpt: each block a lockstep::checkpoint segment
  double dropout = 0.0;            // --model vit's and gpt's: none, since the ViT underfits in 5 epochs
};

// Bounds of the whole-number flags: beyond them a number is a typo, or would
// be clamped to its type's limit by the parser.
constexpr int64_t kMaxEpochs = 1000000;
constexpr int64_t kMaxCount = 1000000000000000; // samples, steps
constexpr int64_t kMaxThreads = 65536;
constexpr int64_t kMaxReplicas = 1024;

// --optimizer adamw's default peak learning rate: the ViT's best of 1e-3 and
// 3e-3 in 5 epochs (docs/performance.md).
constexpr double kAdamWLr = 3e-3;

// --sharding's values, and PyTorch's ShardingStrategy names for them
// (FULL_SHARD as full-shard or full_shard, in any case).
inline std::map<std::string, std::string> sharding_spellings() {
  std::map<std::string, std::string> names;
  for (const auto& [canonical, pytorch] : {std::pair<std::string, std::string>{"full", "full-shard"},
                                           {"grad-op", "shard-grad-op"}, {"none", "no-shard"}}) {
    std::string underscored = pytorch;
    std::replace(underscored.begin(), underscored.end(), '-', '_');
    names[canonical] = canonical;
    names[pytorch] = canonical;
    names[underscored] = canonical;
  }
  return names;
}

// --data, --synthetic, the sample counts and --export-mnist.
inline void add_data_options(CLI::App& app, DataOptions& data, std::string& export_dir) {
  using common::whole_number;
  app.add_option("--data", data.dir, "Directory with MNIST-format IDX files (train-images-idx3-ubyte, ..., gzipped or "
                 "not: MNIST, Fashion-MNIST, KMNIST), any number of rows. Default: " + std::string(kFashionMnist) +
                 " (Debian's dataset-fashion-mnist)")
      ->check(CLI::ExistingDirectory)->group("Data");
  app.add_flag("--synthetic", data.synthetic, "Generated data instead, deterministic by --seed (for tests)")
      ->group("Data");
  app.add_option("--train-samples", data.train_size, "Training samples: the first N of the data, or synthetic ones to "
                 "make (default 12000)")
      ->check(common::positive())->check(whole_number(1, kMaxCount))->group("Data");
  app.add_option("--test-samples", data.test_size, "Test samples: the first N of the data, or synthetic ones to make "
                 "(default 2000)")
      ->check(common::positive())->check(whole_number(1, kMaxCount))->group("Data");
  app.add_option("--text", data.text, "--model gpt: train on this file's bytes instead of Debian's fortunes (" +
                 std::string(kFortunes) + ", package fortunes)")
      ->check(CLI::ExistingFile)->group("Data");
  app.add_option("--context", data.context, "--model gpt: tokens (bytes) in each training sequence, and its "
                 "attention's reach")
      ->check(whole_number(2, 4096))->capture_default_str()->group("Data");
  app.add_option("--export-mnist", export_dir, "Write the synthetic dataset as MNIST IDX files into this existing "
                 "directory (60000/10000 samples, MNIST's own counts) and exit")
      ->check(CLI::ExistingDirectory)->group("Data");
}

// The optimizer, its schedule, the seed and the arithmetic.
inline void add_training_options(CLI::App& app, Config& config) {
  using common::whole_number;
  app.add_option("--epochs", config.epochs, "Passes over the training set")->check(common::positive())
      ->check(whole_number(1, kMaxEpochs))
      ->capture_default_str()->group("Training");
  app.add_option("--batch-size", config.batch_size, "Global batch size, split evenly over the ranks or replicas")
      ->check(common::positive())->check(whole_number(1, kMaxCount))->capture_default_str()->group("Training");
  app.add_option("--model", config.model, "The model: cnn (two convolutions, BatchNorm), vit (a Vision "
                 "Transformer: 4x4 patches, 4 pre-norm blocks of width 64, --dropout) or gpt (a decoder-only language "
                 "model over bytes: 4 causal blocks of width 128, tied embeddings, trained on text; its losses, "
                 "accuracies and speeds count predicted tokens). Under --sharding each transformer block is a unit")
      ->check(CLI::IsMember({"cnn", "vit", "gpt"}))->capture_default_str()->group("Training");
  app.add_option("--dropout", config.dropout, "--model vit or gpt: the dropout of its embeddings, attention and MLPs")
      ->check(common::number_in(0.0, 0.9))->capture_default_str()->group("Training");
  app.add_flag("--activation-checkpointing", config.activation_checkpointing, "--model vit or gpt: keep no "
               "activations inside the blocks; backward makes them again (lockstep::checkpoint), for the same "
               "gradients (not with --dropout on 2 or more --replicas, which is refused)")->group("Training");
  app.add_option("--optimizer", config.optimizer, "sgd (with --momentum) or adamw (PyTorch's defaults: betas 0.9 "
                 "and 0.999, weight decay 0.01). Default: sgd for --model cnn, adamw for vit and gpt")
      ->check(CLI::IsMember({"sgd", "adamw"}))->group("Training");
  app.add_option("--lr", config.lr, "Peak learning rate. Default: 0.1 for sgd, 0.003 for adamw")
      ->check(common::positive())->check(common::number_in(0.0, std::numeric_limits<float>::max()))->group("Training");
  app.add_option("--momentum", config.momentum, "SGD momentum")->check(common::number_in(0.0, 1.0))->capture_default_str()
      ->group("Training");
  app.add_option("--schedule", config.schedule, "Learning-rate schedule after the warmup: constant, step (times "
                 "--gamma every --step-epochs epochs) or cosine (down to 0 at the end)")
      ->check(CLI::IsMember({"constant", "step", "cosine"}))->capture_default_str()->group("Training");
  app.add_option("--warmup-steps", config.warmup_steps, "Steps of linear warmup from 0 to --lr")
      ->check(common::non_negative())->check(whole_number(0, kMaxCount))->capture_default_str()->group("Training");
  app.add_option("--step-epochs", config.step_epochs, "Epochs between learning-rate steps (--schedule step)")
      ->check(common::positive())->check(whole_number(1, kMaxEpochs))->capture_default_str()->group("Training");
  app.add_option("--gamma", config.gamma, "Learning-rate factor at each step (--schedule step)")
      ->check(common::number_in(0.0, 1.0))->capture_default_str()->group("Training");
  app.add_option("--seed", config.seed, "Seed of the model, the shuffling and the synthetic data")
      ->check(common::non_negative())->check(whole_number(0, UINT64_MAX))->capture_default_str()->group("Training");
  app.add_option("--precision", config.precision, "Arithmetic of forward and backward: fp32, bf16 (autocast to "
                 "bfloat16) or fp16 (autocast to float16, with a GradScaler, saved in the checkpoint). Parameters, "
                 "gradients and optimizer state stay fp32")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))->capture_default_str()->group("Training");
  app.add_option("--loss-scale-growth-interval", config.growth_interval, "--precision fp16: steps without overflow "
                 "before the loss scale doubles (GradScaler's growth_interval)")
      ->check(common::positive())->check(common::whole_number(1, INT32_MAX))->capture_default_str()->group("Training");
}

// --comm-hook and PowerSGD's settings.
inline void add_comm_hook_options(CLI::App& app, Config& config) {
  using common::whole_number;
  app.add_option("--comm-hook", config.comm_hook, "Under DDP: how each bucket of gradients is reduced: none (a "
                 "plain allreduce), fp16 or bf16 (sent as 16-bit values), or powersgd (low-rank compression with "
                 "error feedback, for slow links; its state is saved in the checkpoint)")
      ->check(CLI::IsMember({"none", "fp16", "bf16", "powersgd"}))->capture_default_str()->group("Distributed");
  app.add_option("--powersgd-rank", config.powersgd_rank, "--comm-hook powersgd: rank of each gradient matrix's "
                 "approximation (lower sends less)")
      ->check(common::positive())->check(whole_number(1, 1024))->capture_default_str()->group("Distributed");
  app.add_option("--powersgd-start", config.powersgd_start, "--comm-hook powersgd: steps of plain allreduce before "
                 "compression starts (about a tenth of the run is a good start)")
      ->check(whole_number(0, kMaxCount))->capture_default_str()->group("Distributed");
}

// Threads per process, and DataParallel's replicas without a launcher.
inline void add_parallelism_options(CLI::App& app, Config& config) {
  using common::whole_number;
  app.add_option("--threads", config.threads, "Intra-op threads per process (default: OMP_NUM_THREADS, which "
                 "lockstep-run sets to each rank's share of the cores, else every core)")
      ->check(common::non_negative())->check(whole_number(0, kMaxThreads))->group("Training");
  app.add_option("--replicas", config.replicas, "Without a launcher: DataParallel CPU replicas (0: "
                 "lockstep::default_devices(): every GPU, or one CPU replica without one)")
      ->check(common::non_negative())->check(whole_number(0, kMaxReplicas))->capture_default_str()->group("Training");
}

// Where the model, the checkpoints and the metrics go, and how often.
inline void add_output_options(CLI::App& app, Config& config) {
  using common::whole_number;
  app.add_option("--out", config.out_dir, "Output folder: metrics.jsonl, model.pt, model.safetensors, "
                 "checkpoint.ckpt, curves.png. Default: runs/<the launcher's run id, else the time>")->group("Outputs");
  app.add_option("--save", config.save_path, "Save the trained model here instead of OUT/model.pt (torch::save; "
                 "loads into a bare model), and as safetensors beside it (FILE with .pt replaced by .safetensors), "
                 "which Python's safetensors reads (examples/python/evaluate.py)")->group("Outputs");
  app.add_option("--init-from", config.init_from, "Start from the weights in this safetensors file, strictly (every "
                 "name, shape and dtype of the --model): a model.safetensors of an earlier run, or Python's "
                 "model.state_dict() saved with safetensors.torch.save_file. A checkpoint that resumes takes "
                 "precedence")->check(CLI::ExistingFile)->group("Outputs");
  app.add_option("--checkpoint", config.checkpoint_path, "Checkpoint file instead of OUT/checkpoint.ckpt: resumed "
                 "from when it exists, written (by rank 0, atomically) every --checkpoint-every steps and every epoch")
      ->group("Outputs");
  app.add_option("--checkpoint-every", config.checkpoint_every, "Optimizer steps between checkpoints, besides every "
                 "epoch")
      ->check(common::positive())->check(whole_number(1, kMaxCount))->capture_default_str()->group("Outputs");
  app.add_option("--eval-every", config.eval_every, "Also evaluate on the test set every N steps (0: after each epoch "
                 "only)")
      ->check(common::non_negative())->check(whole_number(0, kMaxCount))->capture_default_str()->group("Outputs");
  app.add_option("--log-every", config.log_every, "Steps between training records in metrics.jsonl")
      ->check(common::positive())->check(whole_number(1, kMaxCount))->capture_default_str()->group("Outputs");
}

// Under a launcher: the ranks' timeout and FullyShardedDataParallel's strategy.
inline void add_launcher_options(CLI::App& app, Config& config) {
  app.add_option("--timeout", config.timeout_seconds, "Under DDP: seconds to wait for the other ranks (store, "
                 "connections, each collective) before failing. Default: LOCKSTEP_TIMEOUT, else 300")
      ->check(CLI::Range(1, 7 * 24 * 3600))->group("Distributed");
  app.add_option("--sharding", config.sharding, "Under a launcher: FullyShardedDataParallel instead of DDP, with "
                 "this strategy: full (ZeRO-3: parameters, gradients and optimizer state sharded), grad-op (ZeRO-2: "
                 "gradients and optimizer state) or none (DDP's behaviour). Checkpoints are then sharded "
                 "(CHECKPOINT.shards-STEP/) and resume at any world size; --save is still a whole, bare model. "
                 "PyTorch's names work too: full-shard, shard-grad-op, no-shard (or with _)")
      ->transform(CLI::CheckedTransformer(sharding_spellings(), CLI::ignore_case))->group("Distributed");
  app.add_flag("--deterministic", config.deterministic, "The same final parameters, to the bit, at every world size "
               "that divides the micro-batches of a batch (--batch-size / --micro-batch-size), after a resume at "
               "another one, and under DDP, every --sharding and DataParallel (--replicas, which then runs the "
               "micro-batches in turn) alike. Each micro-batch runs alone and the ranks sum exactly. Intra-op threads "
               "default to 1 (--threads), so that every world size computes alike")->group("Distributed");
  app.add_option("--micro-batch-size", config.micro_batch_size, "--deterministic: samples per micro-batch; "
                 "--batch-size must be a multiple of it")
      ->check(CLI::Range(int64_t{1}, kMaxCount))->group("Distributed");
}

inline void add_options(CLI::App& app, DataOptions& data, Config& config, std::string& export_dir) {
  app.set_version_flag("--version", std::string("lockstep-train ") + LOCKSTEP_VERSION);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast); // scripts/main.sh's defaults, then yours
  // Added in this order: --help lists the groups, and the options in each, as they come.
  add_data_options(app, data, export_dir);
  add_training_options(app, config);
  add_comm_hook_options(app, config);
  add_parallelism_options(app, config);
  add_output_options(app, config);
  add_launcher_options(app, config);
  app.footer(
      "Under lockstep-run, torchrun, mpirun or srun, each process is one rank of DistributedDataParallel and reads "
      "its share of each global batch of the epoch's order (drawn from --seed and the epoch); otherwise one process trains with "
      "DataParallel on --replicas CPU replicas.\n"
      "Fault injection, for tests and demos: LOCKSTEP_FAULT=RANK:STEP[:CODE] makes rank RANK exit with CODE (default "
      "3; 'kill' for SIGKILL; 'hang' to stall, ignoring SIGTERM) when it reaches optimizer step STEP, on the first "
      "attempt only (LOCKSTEP_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT 0 or unset).");
}


inline bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A command line refused before anything runs: lockstep-train says so as
// lockstep-run does, and exits with common::kUsageError.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline int refuse(const std::string& message) {
  std::fprintf(stderr, "lockstep-train: %s\nRun 'lockstep-train --help' for usage.\n", message.c_str());
  return common::kUsageError;
}

// Whether a file can be made beside `path`, as its atomic write makes one:
// access() says yes to root on a read-only or pseudo file system (/proc)
// where the write at the end of training would fail. Leaves errno set.
inline bool can_create_beside(const std::string& path) {
  const std::string probe = path + ".probe." + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return false;
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

// --save and --checkpoint, checked before anything is made or trained: a
// missing folder would cost the run, and a folder named as the file fails
// at the first write (or read) otherwise.
inline void check_output_paths(const Config& config) {
  for (const auto& [flag, path] : {std::make_pair("--save", config.save_path),
                                   std::make_pair("--checkpoint", config.checkpoint_path)}) {
    if (path.empty()) {
      continue;
    }
    const std::string named = std::string(flag) + " " + path + ": ";
    if (std::string(flag) == "--save" && ends_with(path, ".safetensors")) {
      throw UsageError(named + "--save names the LibTorch archive, and its safetensors copy is written beside it, "
                       "X.pt's as X.safetensors; give --save " + path.substr(0, path.size() - 12) + ".pt.");
    }
    struct stat info {};
    if (::stat(path.c_str(), &info) == 0) {
      if (S_ISDIR(info.st_mode)) {
        throw UsageError(named + "is a folder; name a file in it, e.g. " + path + "/" +
                         (std::string(flag) == "--save" ? "model.pt" : "checkpoint.ckpt") + ".");
      }
      const int mode = std::string(flag) == "--checkpoint" ? R_OK | W_OK : W_OK; // a checkpoint is resumed from
      if (::access(path.c_str(), mode) != 0) {
        throw UsageError(named + "cannot " + ((mode & R_OK) != 0 ? "read and write" : "write") + " it (" +
                         std::strerror(errno) + "); pick another path.");
      }
    }
    const auto slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    std::error_code ignored;
    const bool in_out_to_make = !config.out_dir.empty() && ::access(config.out_dir.c_str(), F_OK) != 0 &&
        std::filesystem::weakly_canonical(dir, ignored) == std::filesystem::weakly_canonical(config.out_dir + "/", ignored);
    if (in_out_to_make) {
      continue; // --out, which the run makes before it writes anything
    }
    if (::access(dir.c_str(), F_OK) != 0 && errno == ENOENT) {
      throw UsageError(named + "cannot write into " + dir + ": no such folder (" + std::strerror(errno) +
                       "); create the folder first, or pick another path.");
    }
    if (::access(dir.c_str(), W_OK) != 0 || !can_create_beside(path)) {
      throw UsageError(named + "cannot write into " + dir + ": no file can be made there (" + std::strerror(errno) +
                       "); pick another path.");
    }
  }
}

/// Where the safetensors copy of a model saved at `save_path` goes: `.pt`
/// replaced by `.safetensors`, or `.safetensors` added.
inline std::string safetensors_beside(const std::string& save_path) {
  const bool ends_in_pt = ends_with(save_path, ".pt") && save_path.size() > 3;
  return (ends_in_pt ? save_path.substr(0, save_path.size() - 3) : save_path) + ".safetensors";
}

/// The run's three output files, once their defaults are set: the model's
/// two files and the checkpoint must be three files, or the last write
/// would replace another (the checkpoint, which a resume then cannot read).
inline void check_distinct_outputs(const Config& config) {
  const std::vector<std::pair<std::string, std::string>> outputs{
      {"--save", config.save_path},
      {"--save's safetensors copy", safetensors_beside(config.save_path)},
      {"--checkpoint", config.checkpoint_path}};
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t k = i + 1; k < outputs.size(); ++k) {
      std::error_code ignored;
      const auto a = std::filesystem::weakly_canonical(outputs[i].second, ignored);
      const auto b = std::filesystem::weakly_canonical(outputs[k].second, ignored);
      if (a == b) {
        throw UsageError(outputs[i].first + " and " + outputs[k].first + " are one file, " + outputs[k].second +
                         ", which the run would write twice; give them different paths (--save OUT/model.pt and "
                         "--checkpoint OUT/checkpoint.ckpt by default).");
      }
    }
  }
}

// Flags for one way of running given for the other, refused before
// anything is loaded or made (a UsageError: exit code 2): those that need a
// launcher when the process was started alone, and DataParallel's
// --replicas under one.
inline void check_launch_flags(const CLI::App& app, const Config& config, bool launched) {
  if (launched && app.count("--replicas") > 0) {
    throw UsageError("--replicas sets DataParallel's CPU replicas when lockstep-train runs alone; under a launcher "
                     "each process is one rank: set their number with the launcher (lockstep-run --nproc-per-node N), "
                     "and leave --replicas out.");
  }
  if (!launched && config.replicas >= 2 && config.activation_checkpointing && config.dropout > 0) {
    throw UsageError("--activation-checkpointing with --dropout on " + std::to_string(config.replicas) +
                     " DataParallel CPU replicas (--replicas): the replicas draw dropout's "
                     "numbers from one generator at once, so backward's second run of a block would not draw its "
                     "forward's (lockstep::checkpoint). Leave out one of the three (--replicas 1), or run the "
                     "ranks under a launcher (lockstep-run --nproc-per-node 2 lockstep-train ...).");
  }
  if (!launched && app.count("--timeout") > 0) {
    throw UsageError("--timeout is how long a rank waits for the others; alone, lockstep-train has no other rank. Run "
                     "it under a launcher (lockstep-run --nproc-per-node 2 lockstep-train ...), or leave --timeout out.");
  }
  if (!launched && !config.sharding.empty()) {
    throw UsageError("--sharding " + config.sharding + " runs FullyShardedDataParallel over ranks, one process each: "
                     "run it under lockstep-run (or torchrun, mpirun, srun), for example lockstep-run --nproc-per-node "
                     "2 lockstep-train --sharding " + config.sharding + ". Alone, lockstep-train trains with "
                     "DataParallel, which does not shard.");
  }
  if (config.deterministic && config.comm_hook != "none") {
    throw UsageError("--deterministic sums the gradients exactly, itself: it takes no --comm-hook.");
  }
  if (config.comm_hook != "none" && launched && !config.sharding.empty()) {
    throw UsageError("--comm-hook " + config.comm_hook + " sets how DistributedDataParallel reduces its buckets, and "
                     "--sharding " + config.sharding + " trains with FullyShardedDataParallel, which reduces its own: "
                     "leave out one of the two.");
  }
  if (config.comm_hook != "none" && !launched) {
    throw UsageError("--comm-hook " + config.comm_hook + " sets how DistributedDataParallel reduces its buckets: run "
                     "it under a launcher (lockstep-run, torchrun, mpirun, srun), for example lockstep-run "
                     "--nproc-per-node 2 lockstep-train --comm-hook " + config.comm_hook + ".");
  }
}

// Sample counts whose images alone would not fit in this machine's memory
// end in an allocator error that names no flag: refused first.
inline void check_sample_counts(const DataOptions& data) {
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  constexpr double kBytesPerSample = 28 * 28 * sizeof(float);
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  for (const auto& [flag, count, given] : {std::make_tuple("--train-samples", data.train_size, data.first_train),
                                           std::make_tuple("--test-samples", data.test_size, data.first_test)}) {
    const double bytes = static_cast<double>(count) * kBytesPerSample;
    if ((given || data.synthetic) && memory > 0 && bytes > memory) {
      char text[256];
      std::snprintf(text, sizeof(text), "%s %lld needs %.0f GiB for its images (%.0f bytes a sample), more than this "
                    "machine's %.0f GiB of memory; ask for fewer.", flag, static_cast<long long>(count), bytes / kGiB,
                    kBytesPerSample, memory / kGiB);
      throw UsageError(text);
    }
  }
}


// Flags that only one kind of model reads, given for another: the reason to
// refuse, or "".
inline std::string check_model_flags(const CLI::App& app, const Config& config) {
  const bool text = config.model == "gpt";
  for (const char* flag : {"--text", "--context"}) {
    if (!text && app.count(flag) > 0) {
      return std::string(flag) + " sets the language model's text; add --model gpt.";
    }
  }
  for (const char* flag : {"--data", "--synthetic", "--export-mnist"}) {
    if (text && app.count(flag) > 0) {
      return std::string(flag) + " is for the image models; --model gpt trains on text: Debian's fortunes by "
             "default, or --text FILE.";
    }
  }
  if (app.count("--dropout") > 0 && config.model == "cnn") {
    return "--dropout is the ViT's and the GPT's; the CNN has none. Add --model vit or --model gpt, or leave "
           "--dropout out.";
  }
  if (app.count("--momentum") > 0 && config.optimizer == "adamw") {
    return "--momentum is SGD's; AdamW has its own betas. Leave --momentum out, or add --optimizer sgd.";
  }
  return "";
}

// The flags given beside --export-mnist that it does not use ("" without it).
inline std::string flags_export_ignores(const CLI::App& app, const std::string& export_dir) {
  std::string ignored;
  if (export_dir.empty()) {
    return ignored;
  }
  for (const CLI::Option* option : app.get_options()) {
    const std::string name = option->get_name();
    if (option->count() > 0 && name != "--export-mnist" && name != "--seed" && name != "--synthetic" &&
        name != "--threads") {
      ignored += (ignored.empty() ? "" : ", ") + name;
    }
  }
  return ignored;
}

/// Parses and checks the command line into `data`, `config` and
/// `export_dir`: -1 to go on, else the exit code (0 after --help; a refusal,
/// printed, is common::kUsageError).
inline int parse_command_line(
    CLI::App& app,
    int argc,
    char** argv,
    DataOptions& data,
    Config& config,
    std::string& export_dir,
    bool launched) {
  add_options(app, data, config, export_dir);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return e.get_exit_code() == 0 ? app.exit(e) : refuse(e.what());
  }
  if (const std::string ignored = flags_export_ignores(app, export_dir); !ignored.empty()) {
    return refuse("--export-mnist writes the synthetic dataset (MNIST's 60000/10000 samples, by --seed) and exits, so " +
                  ignored + " would have no effect: leave them out, or train in a second command.");
  }
  // Given explicitly, the sample counts take the first N of each split of the files.
  data.first_train = app.count("--train-samples") > 0;
  data.first_test = app.count("--test-samples") > 0;
  if (config.activation_checkpointing && config.model == "cnn") {
    return refuse("--activation-checkpointing checkpoints a transformer's blocks; add --model vit or --model gpt.");
  }
  if (config.optimizer.empty()) {
    config.optimizer = config.model == "cnn" ? "sgd" : "adamw";
  }
  if (app.count("--lr") == 0 && config.optimizer == "adamw") {
    config.lr = kAdamWLr;
  }
  if (const std::string refusal = check_model_flags(app, config); !refusal.empty()) {
    return refuse(refusal);
  }
  if (config.deterministic != (config.micro_batch_size > 0)) {
    return refuse(config.deterministic ? "--deterministic needs --micro-batch-size N: the samples of each micro-batch, "
                                         "the same at every world size."
                                       : "--micro-batch-size sets --deterministic's micro-batches; add --deterministic.");
  }
  if (config.deterministic && config.batch_size % config.micro_batch_size != 0) {
    return refuse("--batch-size " + std::to_string(config.batch_size) + " is not a multiple of --micro-batch-size " +
                  std::to_string(config.micro_batch_size) + ": a batch is a whole number of micro-batches.");
  }
  for (const char* flag : {"--powersgd-rank", "--powersgd-start"}) {
    if (app.count(flag) > 0 && config.comm_hook != "powersgd") {
      std::fprintf(stderr, "lockstep-train: %s has no effect without --comm-hook powersgd (here --comm-hook %s); "
                   "add --comm-hook powersgd to compress, or leave it out.\n", flag, config.comm_hook.c_str());
    }
  }
  if (config.deterministic && config.threads > 1) {
    std::fprintf(stderr, "lockstep-train: note: --threads %d with --deterministic: some kernels split their sums by "
                 "thread, so the bits match runs of the same --threads only; without it, each process computes on "
                 "one thread and every world size gives the same bits.\n", config.threads);
  }
  if (app.count("--loss-scale-growth-interval") > 0 && config.precision != "fp16") {
    std::fprintf(stderr, "lockstep-train: --loss-scale-growth-interval has no effect without --precision fp16 (here "
                 "--precision %s), whose loss scale it grows; add --precision fp16, or leave it out.\n",
                 config.precision.c_str());
  }
  try {
    check_launch_flags(app, config, launched);
    check_output_paths(config);
    check_sample_counts(data);
  } catch (const UsageError& e) {
    return refuse(e.what());
  }
  return -1;
}

} // namespace examples
} // namespace lockstep
