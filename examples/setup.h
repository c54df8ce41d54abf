#pragma once

// lockstep-train's setups: how one process trains, as the training loop
// needs it (Setup). One rank of DistributedDataParallel or of
// FullyShardedDataParallel under a launcher, or DataParallel in one process;
// each with its output folder, its batches, and the checkpoint it resumes
// from.

#include "checkpoint.h"
#include "comm_hook.h"
#include "data.h"
#include "models.h"
#include "options.h"
#include "resume.h"
#include "run_id.h"
#include "sampling.h"

#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

namespace lockstep {
namespace examples {

// ---------------------------------------------------------------------------
// Output folder and checkpoint paths
// ---------------------------------------------------------------------------

// runs/<id>: the job's id, the same for every attempt of a job, so that a
// restarted job finds its checkpoint (run_id.h); else the time.
inline std::string default_out_dir() {
  const std::string id = job_id([](const char* name) { return std::getenv(name); }, parent_process_id());
  if (!id.empty()) {
    return "runs/" + id;
  }
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", std::localtime(&now));
  return std::string("runs/") + text;
}

// Creates `dir` (and its parents); "" if that worked, else why not.
inline std::string make_dir(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error || ::access(dir.c_str(), W_OK) != 0) {
    return "lockstep-train: cannot create or write the output folder " + dir + " (" +
           (error ? error.message() : std::string(std::strerror(errno))) + "); pick another with --out.";
  }
  return "";
}

// Where the group's collectives take their tensors, and so where this rank
// trains: the CPU where the backend reduces CPU tensors, else (NCCL) one GPU
// per rank. A job of one rank has no backend (its group takes any device):
// it trains where the backend "auto" picks would put a larger job, on a GPU
// when there is one.
inline torch::Device group_device(const lockstep::ProcessGroup& group) {
  const bool on_cpu = group.size() == 1 ? !torch::cuda::is_available()
                                        : group.supports(lockstep::Collective::Allreduce, torch::kFloat, torch::kCPU);
  if (on_cpu) {
    return torch::kCPU;
  }
  const int64_t local = lockstep::launched_local_rank();
  const int64_t index = local >= 0 ? local : group.rank();
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index % std::max<int64_t>(1, torch::cuda::device_count())));
}

// Rank 0's output folder, created by rank 0, for every rank: the ranks must
// read the same checkpoint. Every rank fails if rank 0 could not create it.
inline std::string agree_on_out_dir(const lockstep::ProcessGroup& group, const std::string& mine) {
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
inline DataSignature data_signature(const Samples& train, uint64_t seed) {
  auto crc = [](const torch::Tensor& t) {
    const auto bytes = t.contiguous();
    return checkpoint_crc(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
  };
  return DataSignature{train.inputs.size(0), uint64_t{crc(train.inputs)} << 32 | crc(train.labels), seed};
}

// The run's settings as every setup reads them, made once before any
// setup: the output folder made (rank 0's, under a launcher: `group`), and
// the checkpoint and the saved model in it unless --checkpoint and --save
// name other files.
inline Config settled_config(Config config, const lockstep::ProcessGroup* group) {
  if (config.out_dir.empty()) {
    config.out_dir = default_out_dir();
  }
  if (group != nullptr) {
    const int64_t micro_batches = config.deterministic ? config.batch_size / config.micro_batch_size : 0;
    if (config.deterministic && micro_batches % group->size() != 0) {
      throw UsageError("--batch-size " + std::to_string(config.batch_size) + " holds " + std::to_string(micro_batches) +
                       " micro-batches of --micro-batch-size " + std::to_string(config.micro_batch_size) + ", which " +
                       std::to_string(group->size()) + " ranks cannot share evenly; run at a world size that divides " +
                       std::to_string(micro_batches) + ".");
    }
    if (config.batch_size % group->size() != 0) {
      throw UsageError("--batch-size " + std::to_string(config.batch_size) + " does not split evenly over " +
                       std::to_string(group->size()) + " ranks; pick a multiple of " + std::to_string(group->size()) +
                       " (each rank takes batch-size / ranks rows).");
    }
    config.out_dir = agree_on_out_dir(*group, config.out_dir);
  } else {
    const std::string error = make_dir(config.out_dir);
    TORCH_CHECK(error.empty(), error);
  }
  if (config.checkpoint_path.empty()) {
    config.checkpoint_path = config.out_dir + "/checkpoint.ckpt";
  }
  if (config.save_path.empty()) {
    config.save_path = config.out_dir + "/model.pt";
  }
  check_distinct_outputs(config);
  return config;
}

// `plan`, refused (a UsageError) when its epochs would have no step.
inline BatchPlan checked_plan(const BatchPlan& plan) {
  if (const std::string why = no_step_reason(plan); !why.empty()) {
    throw UsageError(why);
  }
  return plan;
}

// ---------------------------------------------------------------------------
// Every rank resumed alike (the resume itself: resume.h)
// ---------------------------------------------------------------------------

// Every rank must resume from the same state, or the ranks would train on
// different data positions (DDP broadcasts rank 0's parameters, which hides a
// different model but not a different position). Each rank shares what it
// resumed from; all fail together, naming the ranks, if they differ. Under
// --sharding each rank holds other shards, so only positions are compared
// (load_sharded checks the shards).
inline void check_ranks_resumed_alike(
    const lockstep::ProcessGroup& group,
    const Config& config,
    const TrainingState& state,
    torch::nn::Module& net,
    torch::optim::Optimizer& optimizer) {
  const bool resumed = state.step > 0 || state.epoch > 0;
  const bool sharded = !config.sharding.empty();
  auto mine = torch::cat({torch::tensor({static_cast<int64_t>(resumed), state.step, state.epoch, state.samples_in_epoch}),
                          hash_tensor(sharded ? 0 : content_hash(model_tensors(net))).reshape({1}),
                          hash_tensor(sharded ? 0 : optimizer_hash(optimizer)).reshape({1})});
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
// The setups: DistributedDataParallel, FullyShardedDataParallel, DataParallel
// ---------------------------------------------------------------------------

// How this process trains, as the training loop needs it: one rank of
// DistributedDataParallel or FullyShardedDataParallel, or DataParallel in one
// process.
struct Setup {
  lockstep::ProcessGroup group; // a group of one under DataParallel
  int rank = 0;
  int world_size = 1;
  std::string description; // "DistributedDataParallel over 2 ranks (gloo)"
  // The wrapped model's forward.
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  // --deterministic: DistributedDataParallelImpl::backward_micro_batches; else empty.
  std::function<double(int64_t, const std::function<torch::Tensor(int64_t)>&)> backward_micro_batches;
  // Steps the model: on the whole model's parameters, or on this rank's
  // shards under --sharding.
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  // The batches of each epoch, and this rank's share (Note [Data order]).
  BatchPlan plan;
  // Sums every rank's tally (a tiny allreduce under DDP; as is with one process).
  std::function<Tally(const Tally&)> combine;
  // Sums a CPU tensor over every rank, in place (as is with one process).
  std::function<void(torch::Tensor&)> sum_over_ranks = [](torch::Tensor&) {};
  // Gives every rank rank 0's buffers (BatchNorm's running statistics).
  std::function<void()> sync_buffers;
  // Called on every rank: while what it returns lives, the bare model holds
  // its whole, current parameters (FullyShardedDataParallel's
  // summon_full_params; nothing to do otherwise).
  std::function<std::shared_ptr<void>()> full_params;
  // Called on every rank: writes the checkpoint of `state`.
  std::function<void(const TrainingState&)> save_checkpoint;
  // Where training starts: the checkpoint's position, or the beginning.
  TrainingState state;
  // Where the model and each batch live: a GPU under NCCL or DataParallel on GPUs.
  torch::Device device = torch::kCPU;
  // --comm-hook powersgd: PowerSGD::compression_rate() (0 before it starts
  // compressing; 1 when no gradient is worth compressing); else empty.
  std::function<double()> compression_rate;
};

// --optimizer: SGD with --momentum, or AdamW with PyTorch's defaults (betas
// 0.9 and 0.999, weight decay 0.01).
inline std::shared_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<torch::Tensor>& params,
                                                              const Config& config) {
  if (config.optimizer == "adamw") {
    return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(config.lr));
  }
  return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(config.lr).momentum(config.momentum));
}

// What every rank of a launched job does alike, under DDP or FSDP: the group,
// this rank's share of each global batch (Note [Data order]), the tallies'
// sum and rank 0's buffers.
inline Setup launched_setup(const lockstep::ProcessGroup& group, TrainerNet& net, const Dataset& data,
                            const Config& config) {
  Setup setup;
  setup.group = group;
  setup.rank = group.rank();
  setup.world_size = group.size();
  setup.device = group_device(group);
  net->to(setup.device);
  setup.plan = checked_plan({data.train.inputs.size(0), config.batch_size, group.size(), group.rank(), config.seed,
                             config.deterministic});
  // Loss and accuracy sums as doubles: exact for any count below 2^53.
  setup.combine = [group, device = setup.device](const Tally& mine) {
    auto sums = torch::tensor({mine.loss_sum, static_cast<double>(mine.correct), static_cast<double>(mine.rows)},
                              torch::kFloat64).to(device);
    group.allreduce(sums);
    sums = sums.cpu();
    auto s = sums.accessor<double, 1>();
    return Tally{s[0], static_cast<int64_t>(s[1]), static_cast<int64_t>(s[2])};
  };
  setup.sum_over_ranks = [group, device = setup.device](torch::Tensor& t) {
    auto on_device = t.to(device);
    group.allreduce(on_device);
    t.copy_(on_device);
  };
  setup.sync_buffers = [group, net] {
    for (auto& buffer : net->buffers()) {
      group.broadcast(buffer, 0);
    }
  };
  setup.full_params = [] { return std::shared_ptr<void>(); };
  return setup;
}

// What a sample of the data is: an image, or a token sequence under --model gpt.
inline const char* sample_noun(const Config& config) {
  return config.model == "gpt" ? "sequences" : "samples";
}

inline void say_launched_setup(const Setup& setup, const Dataset& data, const Config& config) {
  if (setup.rank == 0) {
    std::fprintf(stderr, "lockstep-train: %s, %lld train / %lld test %s, %s, batch %lld (%lld per rank), "
                 "outputs in %s/\n", data.source.c_str(), static_cast<long long>(data.train.inputs.size(0)),
                 static_cast<long long>(data.test.inputs.size(0)), sample_noun(config), setup.description.c_str(),
                 static_cast<long long>(config.batch_size), static_cast<long long>(config.batch_size / setup.world_size),
                 config.out_dir.c_str());
  }
}

// --deterministic: the model's backward_micro_batches as the step's backward.
template <typename Model>
void set_deterministic_step(Setup& setup, Model& model, const Config& config) {
  if (config.deterministic) {
    setup.backward_micro_batches = [model](int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of) mutable {
      return model->backward_micro_batches(step, loss_of);
    };
  }
}

// Where the ranks train, said where it is not the CPU.
inline std::string device_description(const torch::Device& device) {
  return device.is_cpu() ? "" : " on " + device.str();
}

inline std::string deterministic_description(const Config& config) {
  return config.deterministic ? ", deterministic: " + std::to_string(config.batch_size / config.micro_batch_size) +
      " micro-batches of " + std::to_string(config.micro_batch_size) + " a batch" : "";
}

inline lockstep::ProcessGroup launched_group(const Config& config) {
  return lockstep::init_process_group(
      lockstep::ProcessGroupOptions().timeout(std::chrono::seconds(config.timeout_seconds))); // 0: LOCKSTEP_TIMEOUT
}

// One rank of DistributedDataParallel, under lockstep-run or torchrun: the
// ranks resume alike from rank 0's checkpoint file.
inline Setup distributed_setup(const lockstep::ProcessGroup& group, TrainerNet& net, const Dataset& data,
                               const DataSignature& signature, const Config& config) {
  Setup setup = launched_setup(group, net, data, config);
  setup.optimizer = make_optimizer(net->parameters(), config);
  auto& optimizer = *setup.optimizer;
  TrainerHook hook = make_comm_hook(config);
  setup.state = resume(config, setup.plan, signature, group.rank() == 0, [&](TrainingState& state) {
    const bool found = load_checkpoint(config.checkpoint_path, *net, optimizer, state, config.model);
    if (found && hook.powersgd) {
      load_powersgd(*hook.powersgd, state, group.rank(), group.size(), group.rank() == 0);
    }
    return found;
  });
  check_ranks_resumed_alike(group, config, setup.state, *net, optimizer);
  auto options = lockstep::DistributedOptions().comm_hook(hook.hook);
  if (config.deterministic) { // Note [The same bits at any world size] in src/deterministic/micro_batch_step.cpp
    options.deterministic(true).micro_batches(config.batch_size / config.micro_batch_size)
        .micro_batch_size(config.micro_batch_size).seed(config.seed);
  }
  lockstep::DistributedDataParallel<TrainerNet> model(net, group, options);
  setup.forward = [model](const torch::Tensor& x) mutable { return model(x); };
  set_deterministic_step(setup, model, config);
  setup.description = "DistributedDataParallel over " + std::to_string(group.size()) + " ranks (" + group.backend() +
                      ")" + device_description(setup.device) + hook.description + deterministic_description(config);
  if (hook.powersgd) {
    setup.compression_rate = [powersgd = *hook.powersgd] { return powersgd.compression_rate(); };
  }
  setup.save_checkpoint = [group, path = config.checkpoint_path, net, optimizer = setup.optimizer,
                           powersgd = hook.powersgd, device = setup.device,
                           kind = config.model](const TrainingState& state) mutable {
    TrainingState saved = state;
    if (powersgd) {
      saved.comm_hook_states = powersgd_states(*powersgd, group, device); // a collective: before rank 0 alone writes
    }
    if (group.rank() == 0) {
      save_checkpoint(path, *net, *optimizer, saved, kind);
    }
  };
  say_launched_setup(setup, data, config);
  return setup;
}

inline lockstep::ShardingStrategy sharding_strategy(const std::string& flag) {
  return flag == "full" ? lockstep::ShardingStrategy::FullShard
       : flag == "grad-op" ? lockstep::ShardingStrategy::ShardGradOp
                           : lockstep::ShardingStrategy::NoShard;
}

// Note [A whole checkpoint resumed with --sharding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint of DistributedDataParallel or DataParallel holds the whole
// model and a bare optimizer's state, as PyTorch's DCP loads a full state
// dict into FSDP: the model loads under summon_full_params (written back
// into the shards), and the optimizer's state into a bare optimizer over
// the module's parameters, whose share each rank takes
// (shard_full_optimizer_state). Loading is collective, so the ranks first
// agree on which kind of checkpoint there is: a rank without one then
// loads nothing, and check_ranks_resumed_alike names it.
inline bool any_rank_holds_a_whole_checkpoint(const lockstep::ProcessGroup& group, const std::string& path) {
  int64_t mine = 0;
  if (!path.empty() && ::access(path.c_str(), F_OK) == 0) {
    torch::serialize::InputArchive archive;
    open_checkpoint(path, archive);
    torch::Tensor shards;
    mine = archive.try_read("shards", shards) ? 0 : 1;
  }
  auto flag = torch::tensor({mine}).to(group_device(group));
  group.allreduce(flag, lockstep::ReduceOp::Max);
  return flag.cpu().item<int64_t>() != 0;
}

template <typename Model>
bool load_whole_into_shards(Model& model, TrainerNet& net, torch::optim::Optimizer& optimizer, const Config& config,
                            TrainingState& state) {
  auto bare = make_optimizer(net->parameters(), config);
  bool found = false;
  {
    auto full = model->summon_full_params(); // the loaded weights are written back into the shards
    found = load_checkpoint(config.checkpoint_path, *net, *bare, state, config.model);
  }
  model->shard_full_optimizer_state(*bare, optimizer);
  return found;
}

// One rank of FullyShardedDataParallel (--sharding): the optimizer steps this
// rank's shards, and the checkpoints are sharded (Note [Sharded trainer
// checkpoint]), so a run resumes at another world size.
inline Setup sharded_setup(const lockstep::ProcessGroup& group, TrainerNet& net, const Dataset& data,
                           const DataSignature& signature, const Config& config) {
  Setup setup = launched_setup(group, net, data, config);
  auto options = lockstep::ShardingOptions()
                     .strategy(sharding_strategy(config.sharding))
                     .units(net->units())
                     .activation_checkpointing(config.activation_checkpointing); // each block, a Checkpointable
  if (config.deterministic) { // Note [Sharded exact sums] in src/fsdp/deterministic.cpp
    options.deterministic(true).micro_batches(config.batch_size / config.micro_batch_size)
        .micro_batch_size(config.micro_batch_size).seed(config.seed);
  }
  lockstep::FullyShardedDataParallel<TrainerNet> model(net, group, options);
  setup.optimizer = make_optimizer(model->parameters(), config);
  auto& optimizer = *setup.optimizer;
  ShardsRef shards;
  std::string resumed; // said once the shards have loaded
  const bool whole = any_rank_holds_a_whole_checkpoint(group, config.checkpoint_path);
  setup.state = resume(config, setup.plan, signature, group.rank() == 0, [&](TrainingState& state) {
    if (whole) {
      return load_whole_into_shards(model, net, optimizer, config, state);
    }
    shards = load_sharded_checkpoint(config.checkpoint_path, state, config.model);
    return shards.step >= 0;
  }, &resumed);
  if (whole) {
    std::fputs(resumed.c_str(), stderr);
  }
  // The ranks agree on the position first, so that none waits in
  // load_sharded (collective) for a rank that found no checkpoint.
  check_ranks_resumed_alike(group, config, setup.state, *net, optimizer);
  if (shards.step >= 0) {
    try {
      model->load_sharded(optimizer, shards_dir(config.checkpoint_path, shards.step), shards.save_id);
    } catch (const c10::Error& e) { // every rank fails alike: the hint adds no collective
      const std::string said = e.what_without_backtrace();
      TORCH_CHECK(said.find("size mismatch for wpe:") == std::string::npos, said, "\nlockstep-train: 'wpe', the GPT's "
                  "position table, has a row per token of --context: give the --context the checkpoint was written "
                  "with.");
      throw;
    }
    std::fputs(resumed.c_str(), stderr);
  }
  setup.forward = [model](const torch::Tensor& x) mutable { return model(x); };
  setup.full_params = [model]() mutable {
    return std::static_pointer_cast<void>(std::make_shared<lockstep::FullParamsGuard>(model->summon_full_params()));
  };
  set_deterministic_step(setup, model, config);
  setup.description = "FullyShardedDataParallel (--sharding " + config.sharding + ") over " +
                      std::to_string(group.size()) + " ranks (" + group.backend() + ")" +
                      device_description(setup.device) + deterministic_description(config);
  setup.save_checkpoint = [rank = group.rank(), path = config.checkpoint_path, model, optimizer = setup.optimizer,
                           kind = config.model](const TrainingState& state) {
    const int64_t save_id = model->save_sharded(*optimizer, shards_dir(path, state.step));
    if (rank == 0) {
      save_sharded_checkpoint(path, state, save_id, kind);
    }
  };
  say_launched_setup(setup, data, config);
  return setup;
}

// One process with DataParallel on --replicas CPU replicas (0: lockstep's
// default devices), reading the global batches (Note [Data order]).
inline Setup data_parallel_setup(TrainerNet& net, const Dataset& data, const DataSignature& signature,
                                 const Config& config) {
  Setup setup;
  auto options = lockstep::DataParallelOptions();
  if (config.replicas > 0) {
    options.devices(std::vector<torch::Device>(config.replicas, torch::Device(torch::kCPU)));
  } else {
    setup.device = lockstep::default_devices()[0]; // the first GPU, where DataParallel wants the module
    net->to(setup.device);
  }
  if (config.deterministic) { // src/dp/deterministic.cpp
    options.deterministic(true).micro_batches(config.batch_size / config.micro_batch_size)
        .micro_batch_size(config.micro_batch_size).seed(config.seed);
  }
  setup.optimizer = make_optimizer(net->parameters(), config);
  setup.plan = checked_plan({data.train.inputs.size(0), config.batch_size, 1, 0, config.seed, config.deterministic});
  setup.state = resume(config, setup.plan, signature, true, [&](TrainingState& state) {
    return load_checkpoint(config.checkpoint_path, *net, *setup.optimizer, state, config.model);
  });
  lockstep::DataParallel<TrainerNet> model(net, options);
  setup.forward = [model](const torch::Tensor& x) mutable { return model(x); };
  std::string devices;
  for (const auto& d : model->devices()) {
    devices += (devices.empty() ? "" : ",") + d.str();
  }
  set_deterministic_step(setup, model, config);
  setup.description = "DataParallel on [" + devices + "]" + deterministic_description(config);
  setup.combine = [](const Tally& mine) { return mine; };
  setup.sync_buffers = [] {};
  setup.full_params = [] { return std::shared_ptr<void>(); };
  setup.save_checkpoint = [path = config.checkpoint_path, net, optimizer = setup.optimizer,
                           kind = config.model](const TrainingState& state) mutable {
    save_checkpoint(path, *net, *optimizer, state, kind);
  };
  std::fprintf(stderr, "lockstep-train: %s, %lld train / %lld test %s, %s, batch %lld, outputs in %s/\n",
               data.source.c_str(), static_cast<long long>(data.train.inputs.size(0)),
               static_cast<long long>(data.test.inputs.size(0)), sample_noun(config), setup.description.c_str(),
               static_cast<long long>(config.batch_size), config.out_dir.c_str());
  return setup;
}

} // namespace examples
} // namespace lockstep
