#pragma once

// lockstep-train's checkpoints: the model (in a bare module's format, so a
// checkpoint from DistributedDataParallel, DataParallel or a bare model loads
// into any of them), the optimizer state, and where training stands.
// Written atomically: a temporary file, fsync, rename, fsync of the folder.

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace lockstep {
namespace examples {

constexpr int64_t kCheckpointFormat = 1;

/// Where training stands: `step` optimizer steps done, the next batch being
/// batch `batch_in_epoch` of epoch `epoch` (both from 0).
struct TrainingState {
  int64_t epoch = 0;
  int64_t batch_in_epoch = 0;
  int64_t step = 0;
  int64_t world_size = 1;
};

inline void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  TORCH_CHECK(fd >= 0, "lockstep-train: cannot open ", path, " to sync it to disk.");
  ::fsync(fd);
  ::close(fd);
}

inline void save_checkpoint(
    const std::string& path,
    torch::nn::Module& model,
    torch::optim::Optimizer& optimizer,
    const TrainingState& state) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive, optimizer_archive;
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("format", torch::tensor(kCheckpointFormat));
  archive.write("epoch", torch::tensor(state.epoch));
  archive.write("batch_in_epoch", torch::tensor(state.batch_in_epoch));
  archive.write("step", torch::tensor(state.step));
  archive.write("world_size", torch::tensor(state.world_size));
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  archive.save_to(temporary);
  fsync_path(temporary, O_RDONLY);
  TORCH_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, "lockstep-train: cannot rename ", temporary, " to ", path, ".");
  const auto slash = path.find_last_of('/');
  fsync_path(slash == std::string::npos ? "." : path.substr(0, slash + 1), O_RDONLY | O_DIRECTORY);
}

/// Loads `path` into `model`, `optimizer` and `state`; false if there is no
/// such file. A file that is not a whole lockstep-train checkpoint of this
/// model is a clear error.
inline bool load_checkpoint(
    const std::string& path,
    torch::nn::Module& model,
    torch::optim::Optimizer& optimizer,
    TrainingState& state) {
  if (::access(path.c_str(), F_OK) != 0) {
    return false;
  }
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "lockstep-train: checkpoint ", path, " is unreadable (truncated, corrupt, or not a checkpoint): ",
                e.what_without_backtrace(), " Delete it to start from scratch.");
  }
  torch::Tensor format;
  TORCH_CHECK(archive.try_read("format", format) && format.item<int64_t>() == kCheckpointFormat, "lockstep-train: ", path,
              " is not a lockstep-train checkpoint (format ", kCheckpointFormat,
              "); a model saved with torch::save has no training state. Delete it, or point --checkpoint elsewhere.");
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    torch::Tensor epoch, batch, step, world;
    archive.read("epoch", epoch);
    archive.read("batch_in_epoch", batch);
    archive.read("step", step);
    archive.read("world_size", world);
    state = TrainingState{epoch.item<int64_t>(), batch.item<int64_t>(), step.item<int64_t>(), world.item<int64_t>()};
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "lockstep-train: checkpoint ", path, " does not match this model or optimizer: ",
                e.what_without_backtrace(), " It was written by another model configuration; delete it, or point "
                "--checkpoint elsewhere.");
  }
  return true;
}

} // namespace examples
} // namespace lockstep
