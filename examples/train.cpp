// lockstep-train: trains a small convolutional classifier (or a ViT) on
// Fashion-MNIST (or any MNIST-format data), or a small GPT on text, with
// DistributedDataParallel under lockstep-run or torchrun, one process per
// rank (FullyShardedDataParallel with --sharding), or else with
// lockstep::DataParallel on CPU replicas (or GPUs when there are some). It
// evaluates on the whole test set, split over the ranks, after every epoch,
// and leaves its metrics, model, checkpoint and curves in one output folder.
//
//   lockstep-run --nproc-per-node 2 lockstep-train   # Debian's Fashion-MNIST, 2 ranks
//   lockstep-train --data DIR                        # MNIST-format IDX files, gzipped or not, DataParallel
//   lockstep-train --synthetic                       # generated data, deterministic by --seed
//   lockstep-train --help
//
// main() reads top to bottom: options, process settings, data, the setup
// (setup.h: the wrapped model and its optimizer, this rank's batches, and the
// checkpoint it resumes from), then train(), which runs the epochs
// (train_epoch, train_step, evaluate) and reports.

#include "checkpoint.h"
#include "data.h"
#include "fault.h"
#include "metrics.h"
#include "models.h"
#include "options.h"
#include "precision.h"
#include "process_settings.h"
#include "progress.h"
#include "sampling.h"
#include "schedule.h"
#include "scoring.h"
#include "setup.h"
#include "summary.h"
#include "text_data.h"
#include "weights.h"

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using lockstep::examples::BatchPlan;
using lockstep::examples::Config;
using lockstep::examples::TrainerNet;
using lockstep::examples::DataSignature;
using lockstep::examples::Dataset;
using lockstep::examples::DataOptions;
using lockstep::examples::Samples;
using lockstep::examples::Setup;
using lockstep::examples::Tally;
using lockstep::examples::TrainingState;
using lockstep::examples::accuracy;
using lockstep::examples::lr_at;
using lockstep::examples::maybe_inject_fault;
using lockstep::examples::add_perplexity;
using lockstep::examples::mean_loss;
using lockstep::examples::per_second;
using lockstep::examples::percent;
using lockstep::examples::row_unit;
using lockstep::examples::score;
using lockstep::examples::test_loss_words;

// ---------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------

// What the training loop works on.
struct Run {
  TrainerNet& net; // the bare model: evaluated and saved (whole under setup.full_params)
  torch::optim::Optimizer& optimizer;
  lockstep::GradScaler& scaler; // --precision fp16; a pass-through otherwise
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

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Equal hashes mean bitwise-equal models (the restart tests compare them).
uint64_t parameter_hash(torch::nn::Module& module) {
  return lockstep::examples::content_hash(lockstep::examples::model_tensors(module));
}

// Test loss (summed) and right answers over the whole test set: each rank
// takes its share of the rows, and the shares are added up. Rank 0's buffers
// are given to every rank first, so that every share is judged by the model
// rank 0 saves.
Tally evaluate(const Run& run) {
  const auto full = run.setup.full_params();
  run.setup.sync_buffers();
  torch::NoGradGuard no_grad;
  run.net->eval();
  const Samples& test = run.data.test;
  const int64_t n = test.inputs.size(0);
  const int64_t begin = n * run.setup.rank / run.setup.world_size;
  const int64_t end = n * (run.setup.rank + 1) / run.setup.world_size;
  Tally mine;
  const int64_t batch = lockstep::examples::evaluation_rows(test.inputs.dim() == 2 ? test.inputs.size(1) : 0);
  for (int64_t i = begin; i < end; i += batch) {
    const int64_t rows = std::min(batch, end - i);
    auto logits = run.net(test.inputs.narrow(0, i, rows).to(run.setup.device));
    mine += score(logits, test.labels.narrow(0, i, rows).to(run.setup.device), at::Reduction::Sum).second;
  }
  run.net->train();
  return run.setup.combine(mine);
}

// The rows `index` through the model under --precision's autocast: the
// mean loss, and this rank's tally.
std::pair<torch::Tensor, Tally> forward_rows(const Run& run, const torch::Tensor& index) {
  auto x = run.data.train.inputs.index_select(0, index).to(run.setup.device);
  auto y = run.data.train.labels.index_select(0, index).to(run.setup.device);
  const auto autocast = lockstep::examples::autocast_for(run.config, run.setup.device);
  return score(run.setup.forward(x), y, at::Reduction::Mean);
}

// --deterministic: this rank's share of the batch, `index`, as micro-batches
// rank * share .. of the whole batch (Note [The same bits at any world size]).
Tally backward_micro_batches(const Run& run, const torch::Tensor& index, int64_t step) {
  const int64_t size = run.config.micro_batch_size;
  const int64_t first = run.setup.rank * (index.size(0) / size);
  Tally tally;
  run.setup.backward_micro_batches(step, [&](int64_t v) {
    auto [loss, rows] = forward_rows(run, index.narrow(0, (v - first) * size, size));
    tally += rows;
    return run.scaler.scale(loss);
  });
  return tally;
}

// Optimizer step `step` on the training rows `index` at learning rate `lr`;
// returns this rank's tally of the batch.
Tally train_step(const Run& run, const torch::Tensor& index, double lr, int64_t step) {
  // The command line's options, every step: LibTorch 2.x's optimizer load
  // restores a checkpoint's options too, which would keep the old --momentum.
  for (auto& group : run.optimizer.param_groups()) {
    group.options().set_lr(lr);
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&group.options())) {
      sgd->momentum(run.config.momentum);
    }
  }
  run.optimizer.zero_grad();
  Tally tally;
  if (run.setup.backward_micro_batches) {
    tally = backward_micro_batches(run, index, step);
  } else {
    torch::manual_seed(lockstep::examples::step_seed(run.config.seed, step, run.setup.rank));
    torch::Tensor loss;
    std::tie(loss, tally) = forward_rows(run, index);
    run.scaler.scale(loss).backward();
  }
  {
    lockstep::timeline::Span span("optimizer step");
    run.scaler.step(run.optimizer); // skipped on an fp16 overflow, on every rank alike
    run.scaler.update();
  }
  return tally;
}

// Writes where training stands (every rank calls it; rank 0 writes unless
// the checkpoint is sharded).
// Adds every rank's rows trained since the last call to the state's sample
// counts. Called on every rank: a collective.
void sync_sample_counts(const Run& run, TrainingState& state) {
  if (state.sample_counts.defined()) {
    run.setup.sum_over_ranks(state.unsynced_counts);
    state.sample_counts += state.unsynced_counts;
    state.unsynced_counts.zero_();
  }
}

void checkpoint(const Run& run, TrainingState& state) {
  sync_sample_counts(run, state);
  if (!run.config.checkpoint_path.empty()) {
    TrainingState saved = state;
    saved.grad_scaler = lockstep::examples::scaler_bytes(run.scaler);
    run.setup.save_checkpoint(saved);
  }
}

// The epoch's line (rank 0) and record: its training figures over every rank,
// `totals.tested`, and its speed over the rows trained in this attempt.
void report_epoch(const Run& run, const TrainingState& state, lockstep::examples::MetricsLog& metrics,
                  const Totals& totals, double train_seconds, double seconds, double lr, int64_t resumed_rows) {
  const Tally& done = totals.last_epoch;
  const Tally& tested = totals.tested;
  if (run.setup.rank == 0) {
    std::printf("lockstep-train: epoch %lld/%d: train loss %.4f, train accuracy %s, %s, test accuracy %s, %.1f s\n",
                static_cast<long long>(state.epoch + 1), run.config.epochs, mean_loss(done), percent(done).c_str(),
                test_loss_words(run.config, tested).c_str(), percent(tested).c_str(), seconds);
    std::fflush(stdout);
  }
  nlohmann::json record{{"kind", "epoch"}, {"epoch", state.epoch + 1}, {"step", state.step},
                        {"epochs_done", state.epoch + 1}, {"lr", lr}, {"train_loss", mean_loss(done)},
                        {"train_accuracy", accuracy(done)}, {row_unit(run.config), done.rows},
                        {"test_loss", mean_loss(tested)}, {"test_accuracy", accuracy(tested)}, {"seconds", seconds},
                        {per_second(run.config), rate(done.rows - resumed_rows, train_seconds)}};
  add_perplexity(run.config, tested, record);
  if (run.setup.compression_rate) {
    record["compression_rate"] = run.setup.compression_rate(); // PowerSGD's, of the epoch's last step
  }
  metrics.write(record);
}

// --eval-every: an evaluation in the middle of an epoch, recorded and said
// by rank 0; returns its seconds.
double evaluate_mid_epoch(const Run& run, const TrainingState& state, double epochs_done,
                          lockstep::examples::MetricsLog& metrics) {
  const auto eval_start = Clock::now();
  const Tally t = evaluate(run);
  nlohmann::json record{{"kind", "eval"}, {"epoch", state.epoch + 1}, {"step", state.step},
                        {"epochs_done", epochs_done}, {"test_loss", mean_loss(t)}, {"test_accuracy", accuracy(t)}};
  add_perplexity(run.config, t, record);
  metrics.write(record);
  if (run.setup.rank == 0) {
    std::fprintf(stderr, "%slockstep-train: step %lld: %s, test accuracy %s\n", isatty(fileno(stderr)) ? "\n" : "",
                 static_cast<long long>(state.step), test_loss_words(run.config, t).c_str(),
                 percent(t).c_str()); // below the progress bar's line on a terminal
  }
  return seconds_since(eval_start);
}

// Where an epoch stands between its steps.
struct Epoch {
  Clock::time_point start = Clock::now();
  int64_t rows = 0;         // its training rows over every rank
  int64_t batch_count = 0;  // its steps
  int64_t total_steps = 0;  // the whole run's
  // The schedule's step less the optimizer's: not 0 when the run resumed
  // under another batch or world size (Note [The schedule after a resume]).
  int64_t schedule_shift = 0;
  int64_t fold_every = 1;
  int64_t resumed_rows = 0; // trained before this attempt resumed it
  Tally pending;            // this rank's rows since the last fold
  Tally logged;             // the epoch's tally at the last training record
  int64_t logged_step = 0;  // and its step (the epoch's start, or where this attempt resumed)
  Clock::time_point logged_at = Clock::now();
  double eval_seconds = 0;  // spent on --eval-every evaluations
};

Epoch begin_epoch(const Run& run, const TrainingState& state) {
  Epoch epoch;
  std::tie(epoch.rows, epoch.batch_count) = lockstep::examples::epoch_extent(run.setup.plan);
  epoch.total_steps = epoch.batch_count * run.config.epochs;
  epoch.schedule_shift =
      lockstep::examples::steps_before(run.setup.plan, state.epoch, state.samples_in_epoch) - state.step;
  // Every rank folds its batches into the epoch's tally at the same steps:
  // about 50 times an epoch, every --log-every steps, at checkpoints, and
  // at the epoch's end.
  epoch.fold_every = std::max<int64_t>(1, epoch.batch_count / 50);
  epoch.resumed_rows = state.epoch_tally.rows; // restored when resumed
  epoch.logged = state.epoch_tally;
  epoch.logged_step = state.step;
  return epoch;
}

// Adds every rank's rows since the last fold to the epoch's tally.
void fold(const Run& run, TrainingState& state, Epoch& epoch, lockstep::examples::Progress& progress) {
  Tally& done = state.epoch_tally;
  done += run.setup.combine(epoch.pending);
  epoch.pending = Tally{};
  progress.update(done.rows, mean_loss(done), accuracy(done));
}

// --log-every: the steps since the last record, their loss, accuracy and
// speed over every rank.
void log_training(const Run& run, const TrainingState& state, Epoch& epoch, double epochs_done, double lr,
                  lockstep::examples::MetricsLog& metrics) {
  const Tally& done = state.epoch_tally;
  const Tally recent{done.loss_sum - epoch.logged.loss_sum, done.correct - epoch.logged.correct,
                     done.rows - epoch.logged.rows};
  // "steps": what the figures cover; after a resume, the steps since it.
  nlohmann::json record{{"kind", "train"}, {"epoch", state.epoch + 1}, {"step", state.step},
                        {"steps", state.step - epoch.logged_step}, {"epochs_done", epochs_done}, {"lr", lr},
                        {"loss", mean_loss(recent)},
                        {"accuracy", accuracy(recent)},
                        {per_second(run.config), rate(recent.rows, seconds_since(epoch.logged_at))}};
  if (run.scaler.is_enabled()) {
    record["loss_scale"] = run.scaler.get_scale(); // fp16: backs off at each overflow, the same on every rank
  }
  if (run.setup.compression_rate) {
    record["compression_rate"] = run.setup.compression_rate(); // PowerSGD's, of the last step
  }
  metrics.write(record);
  epoch.logged = done;
  epoch.logged_step = state.step;
  epoch.logged_at = Clock::now();
}

// The epoch's end: evaluates, reports and checkpoints; `state` then stands
// at the next epoch.
void end_epoch(const Run& run, TrainingState& state, const Epoch& epoch, lockstep::examples::MetricsLog& metrics,
               Totals& totals) {
  const Tally& done = state.epoch_tally;
  TORCH_CHECK(done.rows > 0, "lockstep-train: epoch ", state.epoch + 1, " has no training batch (",
              run.data.train.inputs.size(0), " training samples); give more samples.");
  const double seconds = seconds_since(epoch.start);
  totals.train_seconds += seconds - epoch.eval_seconds;
  totals.samples += done.rows - epoch.resumed_rows;
  totals.last_epoch = done;
  totals.tested = evaluate(run);
  report_epoch(run, state, metrics, totals, seconds - epoch.eval_seconds, seconds,
               lr_at(run.config, state.step - 1 + epoch.schedule_shift, epoch.batch_count, epoch.total_steps),
               epoch.resumed_rows);
  ++state.epoch;
  state.samples_in_epoch = 0;
  state.epoch_tally = Tally{};
  checkpoint(run, state); // every epoch, besides every --checkpoint-every steps
}

// Trains the rest of epoch `state.epoch` (all of it unless resumed
// mid-epoch): one step per batch, folding, logging, evaluating and
// checkpointing on the way, then the epoch's end.
void train_epoch(const Run& run, TrainingState& state, lockstep::examples::MetricsLog& metrics, Totals& totals) {
  const Config& config = run.config;
  const int64_t world_size = run.setup.plan.world_size;
  Epoch epoch = begin_epoch(run, state);
  const auto batches = lockstep::examples::rank_batches(run.setup.plan, state.epoch, state.samples_in_epoch);
  const Samples& train = run.data.train; // a tally counts each sample's labels: an image's one, a sequence's tokens
  const int64_t labels_per_sample = train.labels.numel() / std::max<int64_t>(1, train.labels.size(0));
  lockstep::examples::Progress progress(epoch.rows * labels_per_sample, epoch.resumed_rows,
                                        static_cast<int>(state.epoch + 1), config.epochs, run.setup.rank == 0,
                                        row_unit(config));
  for (size_t i = 0; i < batches.size(); ++i) {
    maybe_inject_fault(run.setup.rank, state.step);
    const double lr = lr_at(config, state.step + epoch.schedule_shift, epoch.batch_count, epoch.total_steps);
    epoch.pending += train_step(run, batches[i], lr, state.step);
    if (state.unsynced_counts.defined()) {
      state.unsynced_counts.index_add_(0, batches[i], torch::ones({batches[i].size(0)}, torch::kInt32));
    }
    ++state.step;
    state.samples_in_epoch += batches[i].size(0) * world_size; // every rank takes as many rows
    const double epochs_done = state.epoch + static_cast<double>(state.samples_in_epoch) / epoch.rows;
    const bool last = i + 1 == batches.size();
    const bool save = state.step % config.checkpoint_every == 0 && !last; // the epoch's end saves anyway
    const bool log = state.step % config.log_every == 0;
    if (save || log || last || state.step % epoch.fold_every == 0) {
      fold(run, state, epoch, progress);
    }
    if (log) {
      log_training(run, state, epoch, epochs_done, lr, metrics);
    }
    if (config.eval_every > 0 && state.step % config.eval_every == 0 && !last) {
      epoch.eval_seconds += evaluate_mid_epoch(run, state, epochs_done, metrics);
      epoch.logged_at = Clock::now(); // not a training step's time
    }
    if (save) {
      checkpoint(run, state);
    }
  }
  end_epoch(run, state, epoch, metrics, totals);
}

// Every rank's hash of its whole parameters, compared: a collective. Rank
// 0's words for the summary line, or an error naming the first rank whose
// parameters differ from rank 0's.
std::string ranks_agree_on_parameters(const Run& run) {
  const uint64_t mine = parameter_hash(*run.net);
  auto hashes = torch::zeros({run.setup.world_size}, torch::kLong);
  std::memcpy(hashes.data_ptr<int64_t>() + run.setup.rank, &mine, sizeof(mine));
  run.setup.sum_over_ranks(hashes); // each rank fills its own slot
  for (int r = 1; r < run.setup.world_size; ++r) {
    TORCH_CHECK(hashes[r].item<int64_t>() == hashes[0].item<int64_t>(), "lockstep-train: rank ", r, " ended with other "
                "parameters than rank 0's: the ranks are out of step. Rerun with LOCKSTEP_DEBUG=detail, and report it.");
  }
  char text[96];
  std::snprintf(text, sizeof(text), "final parameters fnv1a64=%016llx", static_cast<unsigned long long>(mine));
  return run.setup.world_size > 1 ? text + (", the same on all " + std::to_string(run.setup.world_size) + " ranks")
                                  : std::string(text);
}

// A checkpoint of a run that trained every epoch: evaluated again (on every
// rank), and said so by rank 0.
void report_finished_run(const Run& run, const TrainingState& state) {
  const Tally tested = evaluate(run);
  const auto full = run.setup.full_params();
  if (run.setup.rank != 0) {
    return;
  }
  std::printf("lockstep-train: nothing to train: the checkpoint %s has trained %lld epoch(s) in %lld steps, and "
              "--epochs is %d; raise --epochs to train on, or point --checkpoint elsewhere to start afresh.\n",
              run.config.checkpoint_path.c_str(), static_cast<long long>(state.epoch),
              static_cast<long long>(state.step), run.config.epochs);
  std::printf("lockstep-train: test accuracy %s of the checkpoint's model\n", percent(tested).c_str());
  std::printf("lockstep-train: final parameters fnv1a64=%016llx\n", static_cast<unsigned long long>(parameter_hash(*run.net)));
}

// --save and the safetensors file beside it, added to `outputs`.
void save_final_model(const Run& run, std::vector<std::string>& outputs) {
  const std::string& path = run.config.save_path;
  const std::string safetensors = lockstep::examples::safetensors_beside(path);
  try {
    torch::save(run.net, path);
    lockstep::save_safetensors(run.net, safetensors);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "lockstep-train: cannot write the model to --save ", path, ": ", e.what_without_backtrace());
  }
  outputs.push_back(path);
  outputs.push_back(safetensors);
}

// Rank 0's last words: saves the model, draws the curves, and prints the
// summary and the list of outputs.
void report_summary(const Run& run, const TrainingState& state, const Totals& totals, double seconds,
                    const std::string& parameters) {
  const Config& config = run.config;
  const int world_size = run.setup.world_size;
  std::vector<std::string> outputs{"metrics.jsonl"};
  if (!config.save_path.empty()) {
    save_final_model(run, outputs);
  }
  if (!config.checkpoint_path.empty()) {
    outputs.push_back(config.checkpoint_path);
  }
  const auto curves = lockstep::examples::plot_curves(config.out_dir);
  const std::string& no_curves = curves.missing;
  if (no_curves.empty()) {
    outputs.push_back("curves.png");
  }
  const double samples_per_second = rate(totals.samples, totals.train_seconds);
  const std::string steps = lockstep::examples::describe_steps(state);
  std::printf("lockstep-train: %d epoch(s), %s in %.1f s (%.1f s training) with %s in %s; %.0f %s/s "
              "over all %d rank(s), %.0f per rank\n",
              config.epochs, steps.c_str(), seconds, totals.train_seconds,
              run.setup.description.c_str(), config.precision.c_str(), samples_per_second, row_unit(config), world_size,
              samples_per_second / world_size);
  const Tally& last = totals.last_epoch;
  const Tally& tested = totals.tested;
  std::printf("lockstep-train: last epoch: train loss %.4f, train accuracy %s; %s, test accuracy %s "
              "(%lld of %lld test %s, over %d rank(s))\n",
              mean_loss(last), percent(last).c_str(), test_loss_words(config, tested).c_str(), percent(tested).c_str(),
              static_cast<long long>(tested.correct), static_cast<long long>(tested.rows),
              config.model == "gpt" ? "tokens" : "images", world_size);
  std::printf("lockstep-train: %s\n", lockstep::examples::describe_sample_counts(state.sample_counts, config.epochs).c_str());
  std::printf("lockstep-train: %s\n", parameters.c_str());
  std::printf("lockstep-train: %s\n", lockstep::examples::describe_outputs(config.out_dir, outputs).c_str());
  if (!no_curves.empty()) {
    std::printf("lockstep-train: %s\n", no_curves.c_str());
  }
  if (run.setup.compression_rate) {
    std::printf("lockstep-train: %s\n",
                lockstep::examples::describe_compression(run.setup.compression_rate(), state, config).c_str());
  }
  if (curves.first_non_finite_step >= 0) {
    std::printf("lockstep-train: the training loss stopped being finite (NaN or infinite) by step %lld; the curves "
                "show the finite values before it. Try a lower --lr, or --precision fp32 if another was set.\n",
                static_cast<long long>(curves.first_non_finite_step));
  }
}

// A run resumed at another world size (an elastic job that shrank or grew):
// said, and recorded in metrics.jsonl.
void report_membership_change(const Run& run, const TrainingState& state, lockstep::examples::MetricsLog& metrics) {
  const int64_t before = state.resumed_world_size;
  const int64_t now = run.setup.world_size;
  if (before == 0 || before == now) {
    return;
  }
  std::printf("lockstep-train: membership change: world size %lld -> %lld at step %lld; the global batch stays %lld "
              "(%lld rows per rank)\n", static_cast<long long>(before), static_cast<long long>(now),
              static_cast<long long>(state.step), static_cast<long long>(run.config.batch_size),
              static_cast<long long>(run.config.batch_size / now));
  std::fflush(stdout);
  metrics.write({{"kind", "membership"}, {"step", state.step}, {"epoch", state.epoch + 1},
                 {"samples_in_epoch", state.samples_in_epoch}, {"old_world_size", before}, {"new_world_size", now}});
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
    report_membership_change(run, state, metrics);
  }
  if (state.epoch >= run.config.epochs) {
    report_finished_run(run, state);
    return;
  }
  const std::string warmup = lockstep::examples::warmup_note(
      run.config, lockstep::examples::epoch_extent(run.setup.plan).second);
  if (lead && !warmup.empty()) {
    std::fprintf(stderr, "lockstep-train: %s\n", warmup.c_str());
  }
  const auto start = Clock::now();
  Totals totals;
  while (state.epoch < run.config.epochs) {
    train_epoch(run, state, metrics, totals);
  }
  const double seconds = seconds_since(start);
  const auto full = run.setup.full_params(); // the whole model, to save and hash
  const std::string parameters = ranks_agree_on_parameters(run);
  if (lead) {
    report_summary(run, state, totals, seconds, parameters);
  }
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-train: trains a small CNN classifier (or a ViT) on Fashion-MNIST (or any MNIST-format "
               "data), or a small GPT on text (--model gpt): with "
               "DistributedDataParallel under lockstep-run or torchrun, else with DataParallel on CPU replicas. "
               "Evaluates on the whole test set after each epoch, and writes metrics.jsonl, the model, a checkpoint "
               "and curves.png into --out."};
  DataOptions data_options;
  Config parsed;
  std::string export_dir;
  // Under a launcher (lockstep-run, torchrun, mpirun, srun), one process per rank with
  // DistributedDataParallel or FullyShardedDataParallel; otherwise one process with DataParallel.
  const bool launched = lockstep::launched_by_launcher();
  const int exit_code =
      lockstep::examples::parse_command_line(app, argc, argv, data_options, parsed, export_dir, launched);
  if (exit_code >= 0) {
    return exit_code; // --help, or a refusal
  }
  try {
    lockstep::examples::prepare_process(parsed.threads, parsed.deterministic);
    if (!export_dir.empty()) {
      lockstep::examples::export_synthetic(export_dir, parsed.seed);
      std::printf("lockstep-train: wrote the synthetic dataset (seed %llu) as MNIST IDX files in %s\n",
                  static_cast<unsigned long long>(parsed.seed), export_dir.c_str());
      return 0;
    }
    const Dataset data = parsed.model == "gpt" ? lockstep::examples::load_text_dataset(data_options)
                                               : lockstep::examples::load_dataset(data_options, parsed.seed);
    const DataSignature signature = lockstep::examples::data_signature(data.train, parsed.seed);

    torch::manual_seed(parsed.seed);
    // Under --sharding, ShardingOptions().activation_checkpointing() switches the blocks on (setup.h).
    TrainerNet net(parsed.model, parsed.activation_checkpointing && parsed.sharding.empty(), parsed.dropout,
                   data_options.context);
    lockstep::examples::init_from(net, parsed.init_from);
    std::optional<lockstep::ProcessGroup> group;
    if (launched) {
      group = lockstep::examples::launched_group(parsed);
    }
    const Config config = lockstep::examples::settled_config(parsed, group ? &*group : nullptr);
    const Setup setup = !launched ? lockstep::examples::data_parallel_setup(net, data, signature, config)
                        : config.sharding.empty()
                            ? lockstep::examples::distributed_setup(*group, net, data, signature, config)
                            : lockstep::examples::sharded_setup(*group, net, data, signature, config);
    lockstep::examples::say_if_emulated(config, setup.device, setup.rank == 0);
    lockstep::examples::autocast_for(config, setup.device); // refuses here what autocast cannot run (fp16 on 1.13's CPU)
    const auto scaler = lockstep::examples::make_scaler(config, setup.group, setup.state);
    train(Run{net, *setup.optimizer, *scaler, data, setup, config});
  } catch (const lockstep::examples::UsageError& e) { // a refusal before training, as parse_command_line's
    return lockstep::examples::refuse(e.what());
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e); // its message already says who raised it
    const std::string message = error != nullptr ? error->what_without_backtrace() : e.what();
    std::fprintf(stderr, "%s%s\n", error != nullptr ? "" : "lockstep-train: ", message.c_str());
    const std::string advice = lockstep::examples::out_of_memory_advice(message, parsed, data_options.context);
    if (!advice.empty()) {
      std::fprintf(stderr, "lockstep-train: %s\n", advice.c_str());
    }
    return 1;
  }
  return 0;
}
