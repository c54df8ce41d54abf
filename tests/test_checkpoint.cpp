// lockstep-train's checkpoints: resumed bitwise, refused clearly when they
// are damaged or foreign, and model files that move between the bare module,
// DataParallel and DistributedDataParallel.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/launch.h"
#include "support/modules.h"
#include "support/processes.h"

#include <examples/checkpoint.h>
#include <examples/idx.h>
#include <examples/models.h>
#include <examples/run_id.h>
#include <examples/sampling.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

// The default output folder is the job's, the same for every attempt, so
// that a restart finds its checkpoint: under torchrun without --rdzv-id
// (whose run id is then "none") it was the time, and each restart trained
// from step 0 in a folder of its own.
TEST(Checkpoint, EveryAttemptOfAJobNamesTheSameOutputFolder) {
  using Vars = std::map<std::string, std::string>;
  auto id = [](const Vars& vars, const std::string& agent) {
    return examples::job_id(
        [&](const char* name) {
          auto it = vars.find(name);
          return it == vars.end() ? static_cast<const char*>(nullptr) : it->second.c_str();
        },
        agent);
  };
  const Vars torchrun{{"TORCHELASTIC_RUN_ID", "none"}, {"TORCHELASTIC_RESTART_COUNT", "1"}};
  EXPECT_EQ(id(torchrun, "4242-99"), "torchrun-4242-99");
  EXPECT_EQ(id({{"TORCHELASTIC_RUN_ID", "job7"}, {"TORCHELASTIC_RESTART_COUNT", "0"}}, "4242-99"), "job7");
  EXPECT_EQ(id({{"LOCKSTEP_RUN_ID", "mine"}, {"TORCHELASTIC_RUN_ID", "job7"}}, ""), "mine");
  EXPECT_EQ(id({{"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "2"}}, "1-1"), "slurm-77.2");
  EXPECT_EQ(id({}, "4242-99"), "") << "no launcher: the time names the folder";
  const std::string parent = examples::parent_process_id();
  EXPECT_EQ(parent.rfind(std::to_string(::getppid()) + "-", 0), 0u) << parent;
  EXPECT_EQ(parent, examples::parent_process_id());
}

TEST(Checkpoint, KilledSavesTemporariesAreRemovedAndAFinishedRunSaysSo) {
  const std::string checkpoint = temp("finished.ckpt");
  const std::string stale = checkpoint + ".tmp." + std::to_string(dead_pid());
  const std::string live = checkpoint + ".tmp." + std::to_string(getpid());
  std::ofstream(stale) << "x";
  std::ofstream(live) << "x";
  auto args = trainer("finished", checkpoint);
  auto p = testing::run(args, {}, temp("finished1.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(access(stale.c_str(), F_OK), 0) << "a killed save's temporary file is left";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << "a running save's temporary file was removed";
  // Run again: nothing is left to train, and it says so instead of "loss nan".
  auto again = testing::run(args, {}, temp("finished2.log"), kDeadline);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to train: the checkpoint " + checkpoint + " has trained 2 epoch(s) in 32 steps, "
                              "and --epochs is 2; raise --epochs"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("nan"), std::string::npos) << again.output;
  EXPECT_EQ(final_hash(again.output), final_hash(p.output)) << again.output;
}

// The promise of the atomic write, as a user sees it: a trainer killed with
// SIGKILL at any moment, saving every step, leaves a checkpoint that loads,
// and resuming from it reaches the uninterrupted result. LOCKSTEP_KILLS sets
// how many kills (CI: 8; the full check: 50). A run that finishes between
// kills is checked against the reference and started again from scratch.
TEST(Checkpoint, SurvivesSigkillAtRandomMoments) {
  const char* env_kills = std::getenv("LOCKSTEP_KILLS");
  const int kills = env_kills != nullptr ? std::atoi(env_kills) : 8;
  ASSERT_GT(kills, 0) << "LOCKSTEP_KILLS must be a number of kills greater than 0, got '" << env_kills << "'";
  auto job = [](const std::string& name, const std::string& checkpoint) {
    return with_flag(trainer(name, checkpoint), "--checkpoint-every", "1");
  };
  const auto reference = testing::run(job("kill_reference", temp("kill_reference.ckpt")), {kOneThread},
                                      temp("kill_reference.log"), kDeadline);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string checkpoint = temp("killed.ckpt");
  const unsigned seed = std::random_device{}();
  std::mt19937 random(seed);
  // Moments from the start of the process to the end of an uninterrupted run.
  std::uniform_real_distribution<double> moment(0.0, reference.seconds);
  int killed = 0, killed_with_checkpoint = 0, finished = 0;
  auto check_finished = [&](const Process& p) {
    EXPECT_EQ(final_hash(p.output), final_hash(reference.output)) << "seed " << seed << "\n" << p.output;
    ++finished;
    std::remove(checkpoint.c_str());
  };
  for (int attempt = 0; killed < kills && attempt < 4 * kills; ++attempt) {
    const std::string log = temp("killed" + std::to_string(attempt) + ".log");
    auto p = testing::start(job("killed", checkpoint), {kOneThread}, log);
    std::this_thread::sleep_for(std::chrono::duration<double>(moment(random)));
    kill(p.pid, SIGKILL);
    std::vector<Process> one{p};
    testing::wait_all(one, kDeadline);
    if (one[0].exit_code == 0) {
      check_finished(one[0]); // it finished before the kill
      continue;
    }
    ASSERT_EQ(one[0].exit_code, 128 + SIGKILL) << "seed " << seed << "\n" << one[0].output;
    ++killed;
    if (access(checkpoint.c_str(), F_OK) != 0) {
      continue; // killed before its first save
    }
    ++killed_with_checkpoint;
    examples::ConvNet net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    examples::TrainingState state;
    EXPECT_NO_THROW(examples::load_checkpoint(checkpoint, *net, optimizer, state))
        << "seed " << seed << ", kill " << killed << "\n" << one[0].output;
  }
  EXPECT_EQ(killed, kills) << "seed " << seed;
  EXPECT_GT(killed_with_checkpoint, 0) << "seed " << seed << ": no kill came after the first save";
  auto last = testing::run(job("killed", checkpoint), {kOneThread}, temp("killed_last.log"), kDeadline);
  ASSERT_EQ(last.exit_code, 0) << "seed " << seed << "\n" << last.output;
  check_finished(last);
  std::printf("%d kills (%d after the first save), %d runs finished, seed %u\n", killed, killed_with_checkpoint,
              finished, seed);
}

// Inputs the fuzz targets found (tests/fuzz/corpus/*/regression-*).
TEST(Checkpoint, FilesThatTripLibTorchsReaderAreClearErrors) {
  // Damaged checkpoints on which LibTorch's reader threw a std::runtime_error
  // from its TorchScript parser (the trainer ended on an uncaught exception),
  // crashed with SIGSEGV, or leaked: each is refused before LibTorch reads it.
  for (const char* name : {"regression-parser-runtime-error", "regression-parser-segv", "regression-zip-reader-leak"}) {
    const std::string path = std::string(LOCKSTEP_FUZZ_CORPUS) + "/fuzz_checkpoint/" + name;
    examples::ConvNet net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    examples::TrainingState state;
    const std::string message = testing::error_of([&] { examples::load_checkpoint(path, *net, optimizer, state); });
    EXPECT_NE(message.find("lockstep-train: checkpoint " + path + " is damaged: its checksum does not match its content"),
              std::string::npos) << name << ": " << message;
  }
}

TEST(Checkpoint, TruncatedOrForeignFilesNeverReachLibTorch) {
  const std::string path = temp("truncated.ckpt");
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  const std::string whole = read_text(path);
  examples::TrainingState state;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() / 2);
  EXPECT_ERROR_SAYS(examples::load_checkpoint(path, *net, optimizer, state), "is damaged: its header declares");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << whole.substr(0, 10);
  EXPECT_ERROR_SAYS(examples::load_checkpoint(path, *net, optimizer, state), "is unreadable");
}

TEST(Checkpoint, EpochTallyOfAnotherShapeIsAClearError) {
  // A checkpoint whose epoch_tally is not 3 doubles: read past its end before.
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
  net->save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("format", torch::tensor(examples::kCheckpointFormat));
  for (const char* key : {"epoch", "samples_in_epoch", "step", "world_size", "batch_size"}) {
    archive.write(key, torch::tensor(int64_t{1}));
  }
  archive.write("data", torch::tensor({int64_t{1}, int64_t{2}, int64_t{3}}));
  archive.write("epoch_tally", torch::tensor({1.0}, torch::kFloat64));
  archive.write("model_hash", examples::hash_tensor(examples::content_hash(examples::model_tensors(*net))));
  archive.write("optimizer_hash", examples::hash_tensor(examples::optimizer_hash(optimizer)));
  const std::string path = temp("short_tally.ckpt");
  examples::write_checkpoint_file(path, archive);
  examples::TrainingState state;
  EXPECT_ERROR_SAYS(examples::load_checkpoint(path, *net, optimizer, state),
                    "does not match this model or optimizer: its epoch_tally is [1] double, not 3 doubles.");
}

TEST(Checkpoint, CorruptOrForeignFilesAreClearErrors) {
  const std::string garbage = temp("garbage.ckpt");
  std::ofstream(garbage) << "not a checkpoint";
  auto p = testing::run(trainer("garbage", garbage), {}, temp("garbage.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("checkpoint " + garbage + " is unreadable"), std::string::npos) << p.output;

  const std::string foreign = temp("foreign.ckpt");
  examples::ConvNet net;
  torch::save(net, foreign);
  p = testing::run(trainer("foreign", foreign), {}, temp("foreign.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("is not a lockstep-train checkpoint"), std::string::npos) << p.output;
}

TEST(Checkpoint, AnotherModelsShapesAreAClearError) {
  // Names match the trainer's model, one shape does not: LibTorch's load alone
  // would take it silently.
  const std::string path = temp("other_shapes.ckpt");
  examples::ConvNet net;
  net->fc2->weight.set_data(torch::zeros({5, 128}));
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  auto p = testing::run(trainer("other_shapes", path), {}, temp("other_shapes.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("does not match this model: 'fc2.weight' is [5, 128] float there but [10, 128] float here"),
            std::string::npos) << p.output;
}

// An SGD run's checkpoint under AdamW: LibTorch's AdamW load fails an
// internal assert on SGD's state, which named no flag.
TEST(Checkpoint, AnotherOptimizersCheckpointNamesTheFlag) {
  const std::string path = temp("sgd_run.ckpt");
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  auto args = trainer("sgd_run", path);
  args.insert(args.end(), {"--optimizer", "adamw"});
  auto p = testing::run(args, {}, temp("sgd_run.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("was written by --optimizer sgd, and this run uses --optimizer adamw; give --optimizer "
                          "sgd to resume it"), std::string::npos) << p.output;
}

// A ViT run that finds a CNN's checkpoint: the optimizer's kind, checked
// first, blamed --optimizer, and giving it failed on the first tensor; neither
// named --model.
TEST(Checkpoint, AnotherModelsCheckpointNamesTheFlag) {
  const std::string path = temp("cnn_run.ckpt");
  examples::TrainerNet cnn("cnn");
  torch::optim::SGD sgd(cnn->parameters(), 0.1);
  examples::save_checkpoint(path, *cnn, sgd, examples::TrainingState{}, "cnn");
  examples::TrainerNet vit("vit");
  torch::optim::AdamW adamw(vit->parameters(), 1e-3);
  examples::TrainingState state;
  EXPECT_ERROR_SAYS(examples::load_checkpoint(path, *vit, adamw, state, "vit"), "was written by --model cnn, and this "
                    "run uses --model vit; give --model cnn (and the options it was written with) to resume it");
  torch::optim::SGD vit_sgd(vit->parameters(), 0.1);
  EXPECT_ERROR_SAYS(examples::load_checkpoint(path, *vit, vit_sgd, state, "vit"), "give --model cnn");
  examples::TrainerNet same("cnn");
  torch::optim::SGD same_sgd(same->parameters(), 0.1);
  EXPECT_TRUE(examples::load_checkpoint(path, *same, same_sgd, state, "cnn"));

  // A sharded checkpoint's index file records it too.
  const std::string sharded = temp("cnn_sharded.ckpt");
  examples::save_sharded_checkpoint(sharded, examples::TrainingState{}, 1, "cnn");
  EXPECT_ERROR_SAYS(examples::load_sharded_checkpoint(sharded, state, "vit"), "was written by --model cnn, and this "
                    "run uses --model vit");
  EXPECT_NO_THROW(examples::load_sharded_checkpoint(sharded, state, "cnn"));

  // The trainer records and checks its --model.
  const std::string trained = temp("cnn_trained.ckpt");
  auto p = testing::run(with_flag(trainer("cnn_trained", trained), "--epochs", "1"), {}, temp("cnn_trained.log"),
                        kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  auto args = trainer("cnn_trained", trained);
  args.insert(args.end(), {"--model", "vit"});
  p = testing::run(args, {}, temp("vit_on_cnn.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("was written by --model cnn, and this run uses --model vit"), std::string::npos) << p.output;
}

// A CPU run's checkpoint resumed on a GPU: LibTorch's load moved every
// parameter to the device that saved it, so the model trained on the CPU
// beside a GPU optimizer that DataParallel refused, with the optimizer's
// state on the CPU. (A GPU run's file on a machine without one failed as
// "unreadable", with advice to delete it.)
TEST(Checkpoint, ACpuCheckpointResumesOnTheGpu_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const std::string path = temp("cpu_to_gpu.ckpt");
  examples::ConvNet saved;
  torch::optim::Adam adam(saved->parameters(), 1e-3);
  saved(torch::randn({4, 1, 28, 28})).sum().backward();
  adam.step();
  examples::save_checkpoint(path, *saved, adam, examples::TrainingState{});

  const torch::Device gpu(torch::kCUDA, 0);
  examples::ConvNet net;
  net->to(gpu);
  torch::optim::Adam resumed(net->parameters(), 1e-3);
  examples::TrainingState state;
  ASSERT_TRUE(examples::load_checkpoint(path, *net, resumed, state));
  for (const auto& t : net->named_parameters()) {
    EXPECT_EQ(t.value().device(), gpu) << t.key();
  }
  for (const auto& t : net->named_buffers()) {
    EXPECT_EQ(t.value().device(), gpu) << t.key();
  }
  EXPECT_TRUE(torch::equal(net->fc2->weight.cpu(), saved->fc2->weight));
  const auto optimizer_state = examples::optimizer_tensors(resumed);
  ASSERT_FALSE(optimizer_state.empty());
  for (const auto& [param, kept] : optimizer_state) {
    EXPECT_EQ(kept.device(), gpu);
  }
}

// One rank under a launcher trains on the GPU, as two do, though its group
// (of one, with no backend) would take tensors on any device.
TEST(TrainerSharding, OneLaunchedRankTrainsOnTheGpu_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  for (const std::string strategy : {"", "full"}) {
    SCOPED_TRACE("--sharding " + strategy);
    const std::string name = "one_rank_gpu" + strategy;
    auto p = launch({"--nproc-per-node", "1", "--master-port", port()},
                    strategy.empty() ? trainer(name) : sharded(trainer(name), strategy), name, {kOneThread});
    ASSERT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find("over 1 ranks (local) on cuda:0"), std::string::npos) << p.output;
  }
}

TEST(Checkpoint, DamagedContentIsAClearError) {
  const std::string path = temp("damaged.ckpt");
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  // Flip bytes in the middle of the file: inside fc1.weight, most of its bytes.
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(0, std::ios::end);
  const auto size = static_cast<std::streamoff>(file.tellg());
  for (std::streamoff at = size / 2; at < size / 2 + 64; ++at) {
    file.seekg(at);
    const char c = static_cast<char>(file.get() ^ 0x5a);
    file.seekp(at);
    file.put(c);
  }
  file.close();
  auto p = testing::run(trainer("damaged", path), {}, temp("damaged.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_TRUE(p.output.find("checkpoint " + path + " is damaged") != std::string::npos ||
              p.output.find("checkpoint " + path + " is unreadable") != std::string::npos)
      << p.output;
}

TEST(Checkpoint, DataParallelRunResumesUnderTheLauncher) {
  const std::string checkpoint = temp("cross.ckpt");
  auto one_epoch = with_flag(trainer("cross1", checkpoint), "--epochs", "1");
  auto p = testing::run(one_epoch, {}, temp("cross1.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("DataParallel on [cpu,cpu]"), std::string::npos) << p.output;
  auto q = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("cross2", checkpoint), "cross2");
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("resumed from " + checkpoint + " at step 16 (epoch 2, sample 0 of 1024); written over 1 rank(s): the data "
                          "order goes on unchanged"),
            std::string::npos) << q.output;
  EXPECT_NE(q.output.find("DistributedDataParallel over 2 ranks"), std::string::npos) << q.output;
}

// Dropout draws from a generator seeded by (seed, step, rank): a resumed
// run draws the masks the uninterrupted one drew (they were drawn again
// from the run's start), and each rank its own. A training record says
// how many steps its figures cover.
TEST(Checkpoint, ADropoutModelResumesBitwise) {
  auto vit = [](const std::string& marker, const std::string& checkpoint) {
    auto args = with_flag(with_flag(trainer(marker, checkpoint), "--train-samples", "512"), "--epochs", "1");
    args.insert(args.end(), {"--model", "vit", "--dropout", "0.3", "--log-every", "3"});
    return args;
  };
  auto whole = launch({"--nproc-per-node", "2", "--master-port", port()}, vit("vit_whole", temp("vit_whole.ckpt")),
                      "vit_whole", {kOneThread});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto resumed = launch({"--nproc-per-node", "2", "--master-port", port(), "--max-restarts", "1"},
                        vit("vit_resumed", temp("vit_resumed.ckpt")), "vit_resumed",
                        {"LOCKSTEP_FAULT=1:6", kOneThread});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("at step 4"), std::string::npos) << resumed.output;
  EXPECT_EQ(final_hash(resumed.output), final_hash(whole.output)) << resumed.output;
  // The record at step 6 covers steps 4 to 6, or 5 and 6 after the resume at 4, and says so.
  for (const auto& [marker, steps] : {std::make_pair("vit_whole", 3), std::make_pair("vit_resumed", 2)}) {
    std::ifstream metrics(temp(std::string(marker) + "_out") + "/metrics.jsonl");
    int found = 0;
    for (std::string line; std::getline(metrics, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record["kind"] == "train" && record["step"] == 6) {
        EXPECT_EQ(record["steps"], steps) << marker << ": " << line;
        ++found;
      }
    }
    EXPECT_EQ(found, 1) << marker;
  }
  EXPECT_NE(examples::step_seed(1, 5, 0), examples::step_seed(1, 5, 1));
  EXPECT_NE(examples::step_seed(1, 5, 0), examples::step_seed(1, 6, 0));
}

TEST(Checkpoint, ModelFilesMoveBetweenBareDataParallelAndDdp) {
  const std::string path = temp("model.pt");
  examples::ConvNet bare, dp_net, ddp_net;
  DataParallel<examples::ConvNet> dp(dp_net, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  DistributedDataParallel<examples::ConvNet> ddp(ddp_net, ProcessGroup());

  torch::save(ddp, path); // DDP -> bare and DataParallel
  torch::load(bare, path);
  torch::load(dp, path);
  EXPECT_TRUE(testing::parameters_equal(*bare, *ddp_net));
  EXPECT_TRUE(testing::parameters_equal(*dp_net, *ddp_net));

  examples::ConvNet other;
  torch::save(other, path); // bare -> DDP
  torch::load(ddp, path);
  EXPECT_TRUE(testing::parameters_equal(*ddp_net, *other));

  examples::ConvNet third;
  DataParallel<examples::ConvNet> dp3(third, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  torch::save(dp3, path); // DataParallel -> DDP
  torch::load(ddp, path);
  EXPECT_TRUE(testing::parameters_equal(*ddp_net, *third));
}

// --- --sharding: FullyShardedDataParallel in the trainer ---------------------

std::string hash_of(torch::nn::Module& module) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx",
                static_cast<unsigned long long>(examples::content_hash(examples::model_tensors(module))));
  return text;
}

// "test loss X" of epoch `epoch`'s line.
double test_loss(const std::string& output, int epoch) {
  std::smatch m;
  const std::regex line("epoch " + std::to_string(epoch) + "/[0-9]+: train loss [0-9.]+, train accuracy [0-9.]+%, "
                        "test loss ([0-9.]+)");
  return std::regex_search(output, m, line) ? std::stod(m[1].str()) : -1;
}

TEST(TrainerSharding, EachStrategyTrainsAsDdpDoesAndSavesABareModel) {
  for (const std::string strategy : {"full", "grad-op", "none"}) {
    SCOPED_TRACE("--sharding " + strategy);
    const std::string name = "sharding_" + strategy;
    auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, sharded(trainer(name), strategy), name,
                    {kOneThread});
    ASSERT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find("with FullyShardedDataParallel (--sharding " + strategy + ") over 2 ranks (gloo)"),
              std::string::npos) << p.output;
    // The same data order and averaged gradients as DDP: at 2 ranks each
    // gradient element is the same sum of two, so the result is bitwise DDP's.
    EXPECT_EQ(final_hash(p.output), reference_hash()) << p.output;
    examples::ConvNet bare; // --save is a whole, bare model
    torch::load(bare, temp(name + ".pt"));
    EXPECT_EQ(hash_of(*bare), final_hash(p.output));
  }
}

TEST(TrainerSharding, ResumesFromItsShardsAfterAFailureAndAtAnotherWorldSize) {
  const std::string checkpoint = temp("sharded.ckpt");
  // Rank 1 fails after the checkpoint at step 24; the restart reads the shards.
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--max-restarts", "1"},
                  sharded(trainer("sharded", checkpoint), "full"), "sharded", {"LOCKSTEP_FAULT=1:26", kOneThread});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("resumed from " + checkpoint + " at step 24 (epoch 2, sample 512 of 1024)"), std::string::npos)
      << p.output;
  EXPECT_EQ(final_hash(p.output), reference_hash()) << p.output;
  EXPECT_EQ(access(examples::shards_dir(checkpoint, 32).c_str(), F_OK), 0) << "the last save's shards are missing";
  EXPECT_NE(access(examples::shards_dir(checkpoint, 24).c_str(), F_OK), 0) << "an older save's shards are left";

  // A third epoch at 4 ranks, from the shards of 2 (model and momentum
  // resharded), against DDP doing the same from its own checkpoint.
  const std::string ddp_checkpoint = temp("unsharded.ckpt");
  auto d = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("unsharded", ddp_checkpoint), "unsharded",
                  {kOneThread});
  ASSERT_EQ(d.exit_code, 0) << d.output;
  auto wider = launch({"--nproc-per-node", "4", "--master-port", port()},
                      with_flag(sharded(trainer("sharded4", checkpoint), "full"), "--epochs", "3"), "sharded4", {kOneThread});
  ASSERT_EQ(wider.exit_code, 0) << wider.output;
  EXPECT_NE(wider.output.find("resumed from " + checkpoint + " at step 32 (epoch 3, sample 0 of 1024); written over 2 "
                              "rank(s)"), std::string::npos) << wider.output;
  auto ddp_wider = launch({"--nproc-per-node", "4", "--master-port", port()},
                          with_flag(trainer("unsharded4", ddp_checkpoint), "--epochs", "3"), "unsharded4", {kOneThread});
  ASSERT_EQ(ddp_wider.exit_code, 0) << ddp_wider.output;
  EXPECT_GT(test_loss(wider.output, 3), 0) << wider.output;
  EXPECT_NEAR(test_loss(wider.output, 3), test_loss(ddp_wider.output, 3), 1e-3) << wider.output << ddp_wider.output;

  // Nodes without a shared disk, where only node 0 finds the checkpoint: every
  // rank fails, saying so, and none waits in load_sharded for the other.
  auto nodes = run_two_nodes("sharded_nodes", [&](int node) {
    return sharded(trainer("sharded_nodes" + std::to_string(node), node == 0 ? checkpoint : temp("nowhere_sharded.ckpt")),
                   "full");
  });
  for (const auto& node : nodes) {
    EXPECT_EQ(node.exit_code, 1) << node.output;
    EXPECT_NE(node.output.find("rank 1 started from scratch (no checkpoint found) but rank 0 resumed at step 48"),
              std::string::npos) << node.output;
  }

  // A sharded checkpoint refuses a run without --sharding, and --sharding needs a launcher.
  auto unsharded_run = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("mixed1", checkpoint), "mixed1");
  EXPECT_EQ(unsharded_run.exit_code, 1) << unsharded_run.output;
  EXPECT_NE(unsharded_run.output.find("lockstep-train: checkpoint " + checkpoint + " was written with --sharding: the "
                                      "model and optimizer are in " + examples::shards_dir(checkpoint, 48) + "/. "
                                      "Resume it with --sharding"), std::string::npos) << unsharded_run.output;
  auto alone = testing::run(sharded(trainer("alone"), "full"), {}, temp("alone.log"), kDeadline);
  EXPECT_EQ(alone.exit_code, 2) << alone.output;
  EXPECT_NE(alone.output.find("lockstep-train: --sharding full runs FullyShardedDataParallel over ranks, one process "
                              "each: run it under lockstep-run"), std::string::npos) << alone.output;
}

// A DDP checkpoint holds the whole model: a resume with --sharding shards
// it on load (Note [A whole checkpoint resumed with --sharding]), momentum
// included, where it was refused. At 2 ranks every strategy steps bitwise
// as DDP does, so each resumed run ends on DDP's own resumed parameters.
TEST(TrainerSharding, ADdpCheckpointResumesUnderEveryStrategy) {
  const std::string ddp = temp("whole.ckpt");
  auto first = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("whole", ddp), "whole", {kOneThread});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  namespace fs = std::filesystem;
  const auto resumed_by = [&](const std::string& name, const std::string& strategy) {
    const std::string copy = temp(name + ".ckpt");
    fs::copy_file(ddp, copy, fs::copy_options::overwrite_existing);
    auto args = with_flag(trainer(name, copy), "--epochs", "3");
    return launch({"--nproc-per-node", "2", "--master-port", port()}, strategy.empty() ? args : sharded(args, strategy),
                  name, {kOneThread});
  };
  const auto reference = resumed_by("whole_ddp", "");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  for (const std::string strategy : {"full", "grad-op", "none"}) {
    const auto p = resumed_by("whole_" + strategy, strategy);
    ASSERT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find("at step 32 (epoch 3, sample 0 of 1024); written with no --sharding, and this run goes "
                            "on with --sharding " + strategy + "\n"), std::string::npos) << p.output;
    EXPECT_EQ(final_hash(p.output), final_hash(reference.output)) << strategy << ": " << p.output;
  }
}

// A checkpoint file beside another run's shards folder of the same name
// (run B, --seed 2, at the same step) loaded B's weights and momentum under
// A's position without a word: the file now names its save, and the
// folder of another is refused on every rank, before any line says that
// the run resumed. A missing folder is named as such.
TEST(TrainerSharding, ACheckpointBesideAnotherRunsShardsIsRefused) {
  const std::string a = temp("run_a.ckpt");
  const std::string b = temp("run_b.ckpt");
  auto run_a = launch({"--nproc-per-node", "2", "--master-port", port()}, sharded(trainer("run_a", a), "full"), "run_a");
  ASSERT_EQ(run_a.exit_code, 0) << run_a.output;
  auto b_args = sharded(trainer("run_b", b), "full");
  b_args.insert(b_args.end(), {"--seed", "2"});
  auto run_b = launch({"--nproc-per-node", "2", "--master-port", port()}, b_args, "run_b");
  ASSERT_EQ(run_b.exit_code, 0) << run_b.output;
  const std::string mixed = temp("mixed.ckpt");
  namespace fs = std::filesystem;
  fs::copy_file(a, mixed, fs::copy_options::overwrite_existing);
  fs::copy(examples::shards_dir(b, 32), examples::shards_dir(mixed, 32), fs::copy_options::recursive);
  auto resumed = launch({"--nproc-per-node", "2", "--master-port", port()},
                        with_flag(sharded(trainer("mixed", mixed), "full"), "--epochs", "3"), "mixed");
  EXPECT_EQ(resumed.exit_code, 1) << resumed.output;
  EXPECT_NE(resumed.output.find("lockstep::load_sharded: " + examples::shards_dir(mixed, 32) + " holds save "),
            std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("that the caller names: the folder was written by another save"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(resumed.output.find("resumed from"), std::string::npos) << resumed.output;

  const std::string alone = temp("alone_file.ckpt");
  fs::copy_file(a, alone, fs::copy_options::overwrite_existing);
  auto missing = launch({"--nproc-per-node", "2", "--master-port", port()},
                        with_flag(sharded(trainer("alone_file", alone), "full"), "--epochs", "3"), "alone_file");
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("lockstep::load_sharded: the folder " + examples::shards_dir(alone, 32) + " is missing"),
            std::string::npos) << missing.output;
  EXPECT_EQ(missing.output.find("index.json"), std::string::npos) << missing.output;
}

} // namespace
} // namespace lockstep
