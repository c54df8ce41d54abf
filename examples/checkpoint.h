#pragma once

// lockstep-train's checkpoints: the model (in a bare module's format, so a
// checkpoint from DistributedDataParallel, DataParallel or a bare model loads
// into any of them), the optimizer state, and where training stands.
// Written atomically: a temporary file, fsync, rename, fsync of the folder;
// read only after a checksum of the whole file (Note [Checkpoint file]).
// Loading checks every tensor's shape against this model and optimizer, and
// the content against hashes stored at save time: a foreign or damaged file is
// an error, never a silently different model.

#include <src/util/checked_file.h> // the library's atomic, checksummed files
#include <common/process_files.h>

#include "models.h"
#include "tensor_hashes.h"

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace examples {

// 3: the position in samples, the batch size and the data's signature; 2
// kept the batch index alone, read only at an epoch's start.
constexpr int64_t kCheckpointFormat = 3;
constexpr int64_t kOldestCheckpointFormat = 2;

/// Sums over training rows: the loss (times rows), the right answers, the rows.
struct Tally {
  double loss_sum = 0;
  int64_t correct = 0;
  int64_t rows = 0;
  Tally& operator+=(const Tally& other) {
    loss_sum += other.loss_sum;
    correct += other.correct;
    rows += other.rows;
    return *this;
  }
};

/// What a run trains on, to tell a resume over other data: the training
/// rows, a checksum of their content, and the seed of their order.
struct DataSignature {
  int64_t rows = 0;
  uint64_t checksum = 0;
  uint64_t seed = 0;
  bool operator==(const DataSignature& other) const {
    return rows == other.rows && checksum == other.checksum && seed == other.seed;
  }
};

/// Where training stands: `step` optimizer steps done, in epoch `epoch` (from
/// 0) after `samples_in_epoch` of its samples over every rank (Note [Data
/// order] in sampling.h), and the tally of the epoch's batches so far over
/// every rank, so that a resumed epoch reports what an uninterrupted one
/// would. `batch_size`, `world_size` and `data` are the run's that wrote it
/// (0 and unknown in a format-2 checkpoint).
struct TrainingState {
  int64_t epoch = 0;
  int64_t samples_in_epoch = 0;
  int64_t step = 0;
  int64_t world_size = 1;
  int64_t batch_size = 0;
  DataSignature data;
  Tally epoch_tally;
  std::string grad_scaler; // --precision fp16: the GradScaler's archive (save()), as bytes; else empty
  std::vector<std::string> comm_hook_states; // --comm-hook powersgd: each rank's PowerSGD::save(), as bytes
  // How often each training row was trained, over every rank, up to `step`
  // (int32, one per row; undefined when resumed from a checkpoint that
  // predates the counts). A resume shows each row trained once per epoch,
  // whatever changed between the runs (Note [Data order] in sampling.h).
  torch::Tensor sample_counts;
  // This rank's rows since `sample_counts`, summed over the ranks at each
  // checkpoint (sync_sample_counts in train.cpp); not saved.
  torch::Tensor unsynced_counts;
  // The settings that change how a step computes, as the run that wrote it
  // gave them ("--precision bf16 --sharding full"); empty in a checkpoint
  // that predates them. A resume with others says so.
  std::string settings;
  // The world size and step of the run this one resumed from; 0 when not resumed. Not saved.
  int64_t resumed_world_size = 0;
  int64_t resumed_step = 0;
};

inline torch::Tensor bytes_tensor(const std::string& bytes) {
  return torch::tensor(std::vector<uint8_t>(bytes.begin(), bytes.end()), torch::kUInt8);
}

// The bytes a checkpoint keeps under `key`, if it has them.
inline bool try_read_bytes(torch::serialize::InputArchive& archive, const std::string& key, std::string& bytes) {
  torch::Tensor t;
  if (!archive.try_read(key, t)) {
    return false;
  }
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == torch::kUInt8, "its ", key, " is ", t.sizes(), " ", t.dtype(),
              ", not bytes.");
  const auto* data = t.data_ptr<uint8_t>();
  bytes.assign(data, data + t.numel());
  return true;
}

// Note [Checkpoint file]
// ~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint file is kCheckpointMagic, the payload's length (8 bytes,
// little-endian), its CRC-32 (4 bytes, zlib's), then the payload: LibTorch's
// archive, a zip. LibTorch's reader trusts what the zip holds: on some
// damaged files it crashes (SIGSEGV in its TorchScript type parser, found by
// fuzz_checkpoint) or leaks. So the whole file is checked before any of it
// reaches LibTorch, and a damaged one is an error that says so. A file made
// to crash LibTorch with a valid checksum still can: checkpoints are trusted
// input, as torch::load's are.
constexpr char kCheckpointMagic[] = "LOCKSTEP-CKPT\n";
constexpr size_t kCheckpointHeader = sizeof(kCheckpointMagic) - 1 + 8 + 4;

inline uint32_t checkpoint_crc(const char* payload, size_t size) {
  return lockstep::detail::crc32_of(payload, size);
}

/// Writes `archive` to `path` atomically (Note [Checkpoint file]): a
/// temporary file, fsync, rename, fsync of the folder.
inline void write_checkpoint_file(const std::string& path, torch::serialize::OutputArchive& archive) {
  std::ostringstream payload;
  archive.save_to(payload);
  lockstep::detail::write_checked_file(path, std::string(kCheckpointMagic, sizeof(kCheckpointMagic) - 1),
                                       payload.str(), "lockstep-train: checkpoint");
}

/// The payload of the checkpoint file at `path`, checked whole (Note
/// [Checkpoint file]); a clear error for any other file.
inline std::string read_checkpoint_payload(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(in.good() || in.eof(), "lockstep-train: cannot read the checkpoint ", path, ".");
  const std::string magic(kCheckpointMagic, sizeof(kCheckpointMagic) - 1);
  if (file.compare(0, magic.size(), magic) != 0) {
    TORCH_CHECK(file.compare(0, 2, "PK") != 0, "lockstep-train: ", path, " is not a lockstep-train checkpoint: it is a "
                "bare LibTorch archive (torch::save's, or an older lockstep-train's), without the training state and "
                "checksum. Delete it, or point --checkpoint elsewhere.");
    TORCH_CHECK(false, "lockstep-train: checkpoint ", path, " is unreadable (truncated, corrupt, or not a checkpoint): "
                "it does not start with lockstep-train's header. Delete it to start from scratch.");
  }
  TORCH_CHECK(file.size() >= kCheckpointHeader, "lockstep-train: checkpoint ", path, " is damaged: truncated inside "
              "its header. Delete it to start from scratch.");
  uint64_t length = 0;
  uint32_t crc = 0;
  for (int i = 0; i < 8; ++i) {
    length |= uint64_t{static_cast<unsigned char>(file[magic.size() + i])} << (8 * i);
  }
  for (int i = 0; i < 4; ++i) {
    crc |= uint32_t{static_cast<unsigned char>(file[magic.size() + 8 + i])} << (8 * i);
  }
  const uint64_t held = file.size() - kCheckpointHeader;
  TORCH_CHECK(length == held, "lockstep-train: checkpoint ", path, " is damaged: its header declares ", length,
              " bytes but it holds ", held, " (truncated, or written over). Delete it to start from scratch.");
  TORCH_CHECK(lockstep::detail::crc32_matches(file.data() + kCheckpointHeader, held, crc), "lockstep-train: checkpoint ", path,
              " is damaged: its checksum does not match its content (corrupted on disk or in transfer). Delete it to "
              "start from scratch, or restore it from a copy.");
  file.erase(0, kCheckpointHeader); // in place: a checkpoint is held once
  return file;
}

// A tensor of the archive as one int64.
inline int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor t;
  archive.read(key, t);
  return t.item<int64_t>();
}

/// Format 2 kept the batch index without the batch size, so the samples
/// trained in its epoch are known at the epoch's start only.
inline void check_old_position(torch::serialize::InputArchive& archive, const std::string& path) {
  torch::Tensor batch_tensor, epoch_tensor;
  const int64_t batch = archive.try_read("batch_in_epoch", batch_tensor) ? batch_tensor.item<int64_t>() : 0;
  const int64_t epoch = archive.try_read("epoch", epoch_tensor) ? epoch_tensor.item<int64_t>() : 0;
  TORCH_CHECK(batch == 0, "lockstep-train: checkpoint ", path, " (format 2, an older lockstep-train's) stands at "
              "batch ", batch, " of epoch ", epoch + 1, ", and that format does not record the batch size, so the "
              "samples that epoch has trained are unknown. Finish the run with the lockstep-train that wrote it, or "
              "delete the checkpoint to start from scratch.");
}

/// The position a checkpoint of `format` stands at (format 2: at an epoch's
/// start, check_old_position).
inline TrainingState read_position(torch::serialize::InputArchive& archive, int64_t format) {
  TrainingState state;
  state.epoch = read_int(archive, "epoch");
  state.step = read_int(archive, "step");
  state.world_size = read_int(archive, "world_size");
  if (format == 2) {
    return state; // at an epoch's start: check_old_position
  }
  state.samples_in_epoch = read_int(archive, "samples_in_epoch");
  state.batch_size = read_int(archive, "batch_size");
  torch::Tensor data;
  archive.read("data", data);
  TORCH_CHECK(data.dim() == 1 && data.numel() == 3 && data.scalar_type() == torch::kInt64, "its data is ",
              data.sizes(), " ", data.dtype(), ", not 3 int64s.");
  auto d = data.accessor<int64_t, 1>();
  state.data.rows = d[0];
  std::memcpy(&state.data.checksum, &d[1], sizeof(uint64_t));
  std::memcpy(&state.data.seed, &d[2], sizeof(uint64_t));
  torch::Tensor counts;
  if (archive.try_read("sample_counts", counts)) {
    TORCH_CHECK(counts.dim() == 1 && counts.numel() == state.data.rows && counts.scalar_type() == torch::kInt32,
                "its sample_counts are ", counts.sizes(), " ", counts.dtype(), ", not ", state.data.rows, " int32s.");
    state.sample_counts = counts;
  }
  return state;
}

/// Where training stands, into a checkpoint's archive.
inline void write_position(torch::serialize::OutputArchive& archive, const TrainingState& state) {
  archive.write("format", torch::tensor(kCheckpointFormat));
  archive.write("epoch", torch::tensor(state.epoch));
  archive.write("samples_in_epoch", torch::tensor(state.samples_in_epoch));
  archive.write("step", torch::tensor(state.step));
  archive.write("world_size", torch::tensor(state.world_size));
  archive.write("batch_size", torch::tensor(state.batch_size));
  archive.write("data", torch::cat({torch::tensor({state.data.rows}), hash_tensor(state.data.checksum).reshape({1}),
                                    hash_tensor(state.data.seed).reshape({1})}));
  archive.write("epoch_tally", torch::tensor({state.epoch_tally.loss_sum, static_cast<double>(state.epoch_tally.correct),
                                             static_cast<double>(state.epoch_tally.rows)}, torch::kFloat64));
  if (state.sample_counts.defined()) {
    archive.write("sample_counts", state.sample_counts);
  }
  if (!state.grad_scaler.empty()) {
    archive.write("grad_scaler", bytes_tensor(state.grad_scaler));
  }
  archive.write("settings", bytes_tensor(state.settings));
  for (size_t r = 0; r < state.comm_hook_states.size(); ++r) {
    archive.write("comm_hook." + std::to_string(r), bytes_tensor(state.comm_hook_states[r]));
  }
}

/// --optimizer's name for `optimizer`: "adamw" or "sgd".
inline std::string optimizer_kind(torch::optim::Optimizer& optimizer) {
  return dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr ? "adamw" : "sgd";
}

/// Checks that the checkpoint at `path` holds a model of `kind`, where both
/// say (a checkpoint written before the key existed does not): a model of
/// another kind would fail on its optimizer, or on its first tensor, without
/// naming --model.
inline void check_model_kind(const std::string& path, torch::serialize::InputArchive& archive,
                             const std::string& kind) {
  std::string written;
  TORCH_CHECK(kind.empty() || !try_read_bytes(archive, "model_kind", written) || written == kind,
              "lockstep-train: checkpoint ", path,
              " was written by --model ", written, ", and this run uses --model ", kind, "; give --model ", written,
              " (and the options it was written with) to resume it, or point --checkpoint elsewhere to start afresh.");
}

/// `kind`: the model's --model, recorded for resuming (check_model_kind); ""
/// records none.
inline void save_checkpoint(
    const std::string& path,
    torch::nn::Module& model,
    torch::optim::Optimizer& optimizer,
    const TrainingState& state,
    const std::string& kind = "") {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive, optimizer_archive;
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("optimizer_kind", bytes_tensor(optimizer_kind(optimizer)));
  if (!kind.empty()) {
    archive.write("model_kind", bytes_tensor(kind));
  }
  write_position(archive, state);
  archive.write("model_hash", hash_tensor(content_hash(model_tensors(model))));
  archive.write("optimizer_hash", hash_tensor(optimizer_hash(optimizer)));
  write_checkpoint_file(path, archive);
}

// Note [Sharded trainer checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under --sharding, every rank writes its shards with lockstep::save_sharded
// into a fresh folder, PATH.shards-STEP; only after every rank has (the save
// ends with a barrier) does rank 0 write PATH itself, which holds where
// training stands, the step whose folder holds the model and the id of the
// save that wrote it, and remove every other PATH.shards-* folder. Writing PATH is the commit: a save
// killed before it leaves PATH naming the previous folder, whole, and the
// half-written one goes at the next save. The folder reshards on loading,
// so the run resumes at any world size and with any --sharding strategy.
// The ranks compare the positions they read before any loads its shards
// (load_sharded is collective), so a rank that found no checkpoint is an
// error on every rank, not a wait. load_sharded is given the save's id, so
// a folder that another run (or another save) wrote under that name is
// refused rather than loaded beside this file's position.

inline std::string shards_dir(const std::string& path, int64_t step) {
  return path + ".shards-" + std::to_string(step);
}

/// Removes every PATH.shards-* folder but step `keep`'s.
inline void remove_other_shards(const std::string& path, int64_t keep) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  const std::string prefix = file.filename().string() + ".shards-";
  const std::string kept = fs::path(shards_dir(path, keep)).filename().string();
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && name != kept) {
      lockstep::detail::remove_tree(entry.path().string()); // best effort: a folder left costs disk, not correctness
    }
  }
}

/// Rank 0's part of a sharded save, after every rank's save_sharded into
/// shards_dir(path, state.step), which returned `save_id` (Note [Sharded
/// trainer checkpoint]).
inline void save_sharded_checkpoint(const std::string& path, const TrainingState& state, int64_t save_id,
                                    const std::string& kind) {
  torch::serialize::OutputArchive archive;
  archive.write("model_kind", bytes_tensor(kind));
  write_position(archive, state);
  archive.write("shards", torch::tensor(state.step));
  archive.write("shards_save_id", torch::tensor(save_id));
  write_checkpoint_file(path, archive);
  remove_other_shards(path, state.step);
}

/// Removes `path`'s temporary files left by saves that were killed (their
/// writer no longer runs); a save in progress elsewhere keeps its own.
inline void remove_stale_temporaries(const std::string& path) {
  common::remove_files_of_dead_processes(path + ".tmp.");
}

// LibTorch's reader throws c10::Error, and on some damaged files the
// TorchScript parser's std::runtime_error: both mean an unreadable file.
inline std::string error_message(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return std::string(error != nullptr ? error->what_without_backtrace() : e.what());
}

/// Reads the checkpoint file at `path` into `archive`, checked whole, and
/// returns its format; a clear error for any other or damaged file. Its
/// tensors come onto the CPU, whatever device wrote them: the position and
/// tallies are read on the host, and a GPU run's file opens without a GPU.
inline int64_t open_checkpoint(const std::string& path, torch::serialize::InputArchive& archive) {
  const std::string payload = read_checkpoint_payload(path);
  try {
    archive.load_from(payload.data(), payload.size(), torch::Device(torch::kCPU));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "lockstep-train: checkpoint ", path, " is unreadable (truncated, corrupt, or not a checkpoint): ",
                error_message(e), " Delete it to start from scratch.");
  }
  torch::Tensor format_tensor;
  const int64_t format = archive.try_read("format", format_tensor) ? format_tensor.item<int64_t>() : 0;
  TORCH_CHECK(format >= kOldestCheckpointFormat && format <= kCheckpointFormat, "lockstep-train: ", path,
              " is not a lockstep-train checkpoint (format ", kOldestCheckpointFormat, " to ", kCheckpointFormat,
              "); a model saved with torch::save has no training state. Delete it, or point --checkpoint elsewhere.");
  if (format == 2) {
    check_old_position(archive, path);
  }
  return format;
}

/// The position and the epoch's tally so far.
inline TrainingState read_state(torch::serialize::InputArchive& archive, int64_t format) {
  TrainingState state = read_position(archive, format);
  torch::Tensor tally;
  if (archive.try_read("epoch_tally", tally)) { // optional: without it, the epoch's figures start at the resumed batch
    TORCH_CHECK(tally.dim() == 1 && tally.numel() == 3 && tally.scalar_type() == torch::kFloat64,
                "its epoch_tally is ", tally.sizes(), " ", tally.dtype(), ", not 3 doubles.");
    auto t = tally.accessor<double, 1>();
    state.epoch_tally = Tally{t[0], static_cast<int64_t>(t[1]), static_cast<int64_t>(t[2])};
  }
  try_read_bytes(archive, "grad_scaler", state.grad_scaler); // optional: written by --precision fp16 only
  try_read_bytes(archive, "settings", state.settings); // optional: older checkpoints lack it
  std::string hook; // optional: written by --comm-hook powersgd only, one per rank
  while (try_read_bytes(archive, "comm_hook." + std::to_string(state.comm_hook_states.size()), hook)) {
    state.comm_hook_states.push_back(hook);
  }
  return state;
}

/// Which save of shards a sharded checkpoint names: the step of its folder
/// and the save's id (none in a checkpoint of an earlier lockstep-train).
struct ShardsRef {
  int64_t step = -1;
  std::optional<int64_t> save_id;
};

/// Loads where training stands from the sharded checkpoint at `path` (Note
/// [Sharded trainer checkpoint]) and returns the save that holds the
/// shards, with step -1 if there is no such file. Its model must be of
/// `kind` (--model).
inline ShardsRef load_sharded_checkpoint(const std::string& path, TrainingState& state, const std::string& kind) {
  if (::access(path.c_str(), F_OK) != 0) {
    return {};
  }
  torch::serialize::InputArchive archive;
  const int64_t format = open_checkpoint(path, archive);
  torch::Tensor shards;
  TORCH_INTERNAL_ASSERT(archive.try_read("shards", shards), "a whole checkpoint goes to load_whole_into_shards");
  check_model_kind(path, archive, kind);
  try {
    state = read_state(archive, format);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "lockstep-train: checkpoint ", path, " is damaged: ", error_message(e), " Delete it to start "
                "from scratch.");
  }
  ShardsRef ref{shards.item<int64_t>(), std::nullopt};
  torch::Tensor save_id;
  if (archive.try_read("shards_save_id", save_id)) {
    ref.save_id = save_id.item<int64_t>();
  }
  return ref;
}

/// LibTorch's load gives each tensor the device of the one it read, the CPU
/// here (open_checkpoint): a run resumed on a GPU would train on the CPU. So
/// the model's tensors go back to the devices they had (set_data: the
/// optimizer holds the same parameters), and the optimizer's state to its
/// parameter's.
template <typename Expected>
void back_onto_the_models_device(const std::vector<torch::Tensor>& loaded, const std::vector<Expected>& expected,
                                 torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < loaded.size(); ++i) {
    if (loaded[i].device() != expected[i].device) {
      auto tensor = loaded[i];
      tensor.set_data(tensor.to(expected[i].device));
    }
  }
  for (auto& [param, state_tensor] : optimizer_tensors(optimizer)) {
    if (state_tensor.defined() && state_tensor.device() != param.device()) {
      state_tensor.set_data(state_tensor.to(param.device()));
    }
  }
}

/// A model tensor as it was before loading replaced it: what the loaded one
/// must match.
struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> sizes;
  caffe2::TypeMeta dtype;
  torch::Device device;
};

/// The model's parameters and buffers, in model_tensors' order.
inline std::vector<ExpectedTensor> expected_tensors(torch::nn::Module& model) {
  std::vector<ExpectedTensor> expected;
  for (const auto& group : {model.named_parameters(), model.named_buffers()}) {
    for (const auto& item : group) {
      expected.push_back({item.key(), item.value().sizes().vec(), item.value().dtype(), item.value().device()});
    }
  }
  return expected;
}

/// Checks that what was loaded from `path` has the shapes and dtypes of the
/// model's tensors, and of the optimizer's parameters.
inline void check_loaded_shapes(const std::string& path, const std::vector<torch::Tensor>& loaded,
                                const std::vector<ExpectedTensor>& expected, torch::optim::Optimizer& optimizer) {
  // LibTorch's load replaces a tensor whatever its shape: compare with the model's.
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& want = expected[i];
    const std::string hint = shape_flag_hint(want.name, loaded[i].sizes(), want.sizes);
    TORCH_CHECK(hint.empty(), "lockstep-train: checkpoint ", path, " does not match this model: ", hint,
                " Or point --checkpoint elsewhere to start afresh.");
    TORCH_CHECK(loaded[i].sizes() == want.sizes && loaded[i].dtype() == want.dtype, "lockstep-train: checkpoint ",
                path, " does not match this model: '", want.name, "' is ", loaded[i].sizes(), " ", loaded[i].dtype(),
                " there but ", c10::IntArrayRef(want.sizes), " ", want.dtype, " here. It was written by another model "
                "configuration; delete it, or point --checkpoint elsewhere.");
  }
  for (const auto& [param, state_tensor] : optimizer_tensors(optimizer)) {
    TORCH_CHECK(!state_tensor.defined() || state_tensor.sizes() == param.sizes(), "lockstep-train: checkpoint ", path,
                " does not match this optimizer: a state tensor is ", state_tensor.sizes(), " for a parameter of ",
                param.sizes(), ". Delete it, or point --checkpoint elsewhere.");
  }
}

/// Reads the model, the optimizer and the training state from `archive`,
/// and returns the content hashes stored beside them (model, optimizer).
inline std::pair<torch::Tensor, torch::Tensor> read_whole_checkpoint(
    const std::string& path, torch::serialize::InputArchive& archive, int64_t format, torch::nn::Module& model,
    torch::optim::Optimizer& optimizer, TrainingState& state, const std::string& kind) {
  torch::Tensor model_hash, stored_optimizer_hash;
  check_model_kind(path, archive, kind);
  std::string written = "sgd"; // every checkpoint without the key is SGD's: the trainer had no other optimizer
  try_read_bytes(archive, "optimizer_kind", written);
  TORCH_CHECK(written == optimizer_kind(optimizer), "lockstep-train: checkpoint ", path, " was written by --optimizer ",
              written, ", and this run uses --optimizer ", optimizer_kind(optimizer), "; give --optimizer ", written,
              " to resume it, or point --checkpoint elsewhere to start afresh.");
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    archive.read("model_hash", model_hash);
    archive.read("optimizer_hash", stored_optimizer_hash);
    state = read_state(archive, format);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "lockstep-train: checkpoint ", path, " does not match this model or optimizer: ",
                error_message(e), " It was written by another model configuration; delete it, or point "
                "--checkpoint elsewhere.");
  }
  return {model_hash, stored_optimizer_hash};
}

/// Loads `path` into `model`, `optimizer` and `state`; false if there is no
/// such file. A file that is not a whole lockstep-train checkpoint of this
/// model is a clear error, and so is one of another `kind` (--model) where
/// both say.
inline bool load_checkpoint(
    const std::string& path,
    torch::nn::Module& model,
    torch::optim::Optimizer& optimizer,
    TrainingState& state,
    const std::string& kind = "") {
  if (::access(path.c_str(), F_OK) != 0) {
    return false;
  }
  torch::serialize::InputArchive archive;
  const int64_t format = open_checkpoint(path, archive);
  torch::Tensor shards;
  TORCH_CHECK(!archive.try_read("shards", shards), "lockstep-train: checkpoint ", path, " was written with --sharding: "
              "the model and optimizer are in ", shards_dir(path, shards.defined() ? shards.item<int64_t>() : 0),
              "/. Resume it with --sharding (any strategy, at any world size), or point --checkpoint elsewhere.");
  const auto expected = expected_tensors(model); // the model's, before loading replaces them
  const auto [model_hash, stored_optimizer_hash] = read_whole_checkpoint(path, archive, format, model, optimizer, state, kind);
  const auto loaded = model_tensors(model);
  check_loaded_shapes(path, loaded, expected, optimizer);
  back_onto_the_models_device(loaded, expected, optimizer);
  const bool model_intact = hash_tensor(content_hash(loaded)).equal(model_hash);
  TORCH_CHECK(model_intact && hash_tensor(optimizer_hash(optimizer)).equal(stored_optimizer_hash),
              "lockstep-train: checkpoint ", path, " is damaged: its ", model_intact ? "optimizer state" : "model",
              " differs from the content hash stored when it was written. Delete it to start from scratch, or "
              "restore it from a copy.");
  return true;
}

} // namespace examples
} // namespace lockstep
