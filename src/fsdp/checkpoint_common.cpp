// What FullyShardedDataParallel's checkpoints share, whichever the format:
// every rank's verdict on a step, the save's id and its agreement across
// ranks, the folder's checks; and the error that says how to checkpoint.

#include "fsdp/checkpoint_common.h"

#include "fsdp/state.h"
#include "io/dcp_hf.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <random>

namespace lockstep {
namespace detail {

torch::Device control_device_of(const ProcessGroup& group, const std::vector<FlatParam*>& flats) {
  return control_device(group, flats.empty() ? torch::Device(torch::kCPU) : flats[0]->device);
}

void on_every_rank(const ProcessGroup& group, torch::Device device, const std::string& failure,
                   const std::function<void()>& step, const char* tells) {
  std::exception_ptr error;
  try {
    step();
  } catch (const std::exception&) { // c10::Error, and a malformed index's json error
    error = std::current_exception();
  }
  auto failed = torch::full({group.size()}, 0, torch::kLong);
  failed[group.rank()] = error ? 1 : 0;
  failed = failed.to(device);
  group.allreduce(failed, ReduceOp::Max);
  failed = failed.cpu();
  if (error) {
    std::rethrow_exception(error);
  }
  for (int r = 0; r < group.size(); ++r) {
    TORCH_CHECK(failed[r].item<int64_t>() == 0, "lockstep::", failure, " on rank ", r,
                " failed; its own error ", tells, ".");
  }
}

int64_t new_save_id(const ProcessGroup& group, torch::Device device) {
  auto id = torch::full({1}, 0, torch::TensorOptions(torch::kLong).device(device));
  if (group.rank() == 0) {
    std::random_device random;
    const auto now = std::chrono::system_clock::now().time_since_epoch().count();
    id.fill_(static_cast<int64_t>(((static_cast<uint64_t>(random()) << 31) ^ static_cast<uint64_t>(now)) >> 1));
  }
  group.broadcast(id, 0);
  return id.item<int64_t>();
}

// Note [One save on every rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank reads the folder it is given, and each folder may be whole and
// valid, yet of another save: a node's local copy one checkpoint behind, or
// ranks that each pick "the newest checkpoint" while one is being written.
// Loaded together they would make one model out of shards of different
// steps, with optimizer steps that differ between ranks. So the ranks
// compare the save id their index carries, before anything is copied in.
void check_same_save(const ProcessGroup& group, torch::Device device, int64_t save_id, const std::string& dir) {
  auto ids = torch::zeros({group.size()}, torch::kLong);
  ids[group.rank()] = save_id;
  ids = ids.to(device);
  group.allreduce(ids, ReduceOp::Sum);
  ids = ids.cpu();
  for (int r = 1; r < group.size(); ++r) {
    TORCH_CHECK(ids[r].item<int64_t>() == ids[0].item<int64_t>(), "lockstep::load_sharded: rank ", r, " loaded "
                "another save than rank 0 (save ids ", ids[r].item<int64_t>(), " and ", ids[0].item<int64_t>(),
                "); this rank, ", group.rank(), ", loaded ", dir, ". Every rank must load the same checkpoint: give "
                "each the same folder, on storage they share or as copies of one save.");
  }
}

namespace {

void check_checkpoint_folder(const std::string& dir) {
  struct stat info {};
  const bool found = ::stat(dir.c_str(), &info) == 0;
  TORCH_CHECK(found && S_ISDIR(info.st_mode), "lockstep::load_sharded: the folder ", dir, " ",
              found ? "is a file" : "is missing (" + std::string(std::strerror(errno)) + ")",
              ": load the folder that save_sharded wrote.");
}

bool is_lockstep_v1_folder(const std::string& dir) {
  struct stat info {};
  return ::stat((dir + "/index.json").c_str(), &info) == 0 &&
      ::stat((dir + "/" + kDcpSaveRecord).c_str(), &info) != 0;
}

} // namespace

// Each rank reads its own `dir` (node-local storage may lack it on one), and
// each branch below runs collectives: a rank that failed alone, or took the
// other format's branch, would leave the others waiting in a collective it
// never calls.
bool is_lockstep_v1_folder_on_every_rank(const ProcessGroup& group, torch::Device device, const std::string& dir) {
  bool v1 = false;
  on_every_rank(group, device, "load_sharded of " + dir, [&] {
    check_checkpoint_folder(dir);
    v1 = is_lockstep_v1_folder(dir);
  });
  auto formats = torch::zeros({group.size()}, torch::kLong);
  formats[group.rank()] = v1 ? 1 : 0;
  formats = formats.to(device);
  group.allreduce(formats, ReduceOp::Sum);
  formats = formats.cpu();
  const auto format = [&](int r) {
    return formats[r].item<int64_t>() == 1 ? "lockstep's earlier sharded format (index.json)"
                                           : "PyTorch's distributed checkpoint layout";
  };
  for (int r = 1; r < group.size(); ++r) {
    TORCH_CHECK(formats[r].item<int64_t>() == formats[0].item<int64_t>(), "lockstep::load_sharded: rank ", r,
                "'s folder holds ", format(r), ", rank 0's ", format(0), "; this rank, ", group.rank(), ", loaded ",
                dir, ". Every rank must load the same checkpoint: give each the same folder, on storage they share "
                "or as copies of one save.");
  }
  return v1;
}

void ShardedCore::refuse_serialization(const char* what) const {
  TORCH_CHECK(false, "lockstep::FullyShardedDataParallel: rank ", group_.rank(), ": ", what, " of the wrapper itself "
              "is refused: its parameters are this rank's shards, without the module's names or buffers, and "
              "another rank would load them as its own. For a full checkpoint that a bare module loads, every rank "
              "runs `{ auto full = model->summon_full_params(); if (rank == 0) torch::save(model->module(), path); }` "
              "(to load one: `{ auto full = model->summon_full_params(); full.writeback(true); "
              "torch::load(model->module(), path); }`); for a sharded one, lockstep::save_sharded and load_sharded.");
}

} // namespace detail
} // namespace lockstep
