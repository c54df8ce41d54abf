#pragma once

// Internal: PyTorch's distributed checkpoint in its Hugging Face layout
// (torch/distributed/checkpoint/hf_storage.py): a folder of safetensors
// files, each holding at most one box of a tensor under the tensor's name,
// with the boxes' offsets in __metadata__["DCP_SHARDING_INFO"], a JSON
// string {"name": {"saved_offsets": [...]}}. A tensor's shape is the
// largest offset + size over its boxes, as HuggingFaceStorageReader takes
// it; no other file is needed. Lockstep adds lockstep_save.json, written
// last, so that a save stopped halfway, or files of two saves, never load
// (Note [Sharded safetensors saves]).

#include "io/boxes.h"
#include "io/safetensors_file.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// One box of a tensor that a rank writes.
struct BoxSource {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  Box box;
  std::function<torch::Tensor()> bytes; // contiguous, CPU, box.sizes
};

/// The file names rank `rank` writes (and removes before a save):
/// shard-<rank+1>-model-<k>-of-<n>.safetensors, as torch's writer names them.
std::string dcp_file_name(int rank, size_t k, size_t n);
/// The number in a shard file's name (rank + 1), or 0 if it is not one.
int dcp_file_rank_number(const std::string& name);

/// Writes `boxes` into `dir`: the k-th box of each tensor goes to file k, so
/// no file holds two boxes of one tensor. `metadata` goes into every file's
/// __metadata__ beside DCP_SHARDING_INFO and the tensors' CRC-32s. Returns
/// the files' names.
std::vector<std::string> write_dcp_boxes(const std::string& dir, int rank, const std::vector<BoxSource>& boxes,
                                         const SafetensorsMetadata& metadata, const std::string& who);

/// A folder's boxes, by tensor name.
struct DcpCheckpoint {
  std::string dir;
  std::vector<SafetensorsFile> files;
  struct Saved {
    size_t file;
    size_t entry;
    Box box;
    std::optional<uint32_t> crc; // lockstep's files carry each tensor's (Note [Sharded safetensors saves])
  };
  std::map<std::string, std::vector<Saved>> boxes; // each box once
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, torch::ScalarType> dtypes;
  nlohmann::json record; // lockstep_save.json; null for a folder PyTorch wrote
};

/// Opens the `files` of `dir` (all of its *.safetensors when empty) and
/// checks that each tensor's boxes agree in dtype and tile its shape.
DcpCheckpoint open_dcp(const std::string& dir, const std::vector<std::string>& files);

/// The *.safetensors files in `dir`, sorted.
std::vector<std::string> safetensors_in(const std::string& dir);

// Note [Sharded safetensors saves]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank writes its own files, each atomically; rank 0 writes
// lockstep_save.json last, once every rank's files are whole, naming the
// save's id and its files, and every file carries the id in its
// __metadata__ (lockstep_save_id). A load reads the files the record names
// and refuses one of another save; a folder whose files carry an id but
// that has no record is a save stopped halfway, refused. A folder without
// either is PyTorch's (HuggingFaceStorageWriter), read whole. Before a save
// writes, rank 0 removes the record and every rank its own earlier files,
// so that PyTorch's reader, which reads every file of the folder, never
// meets another save's; a folder that holds a .safetensors file no
// lockstep save names, or PyTorch's .metadata or .distcp files, is
// refused. Each file's __metadata__ also holds the CRC-32 of each of its
// tensors (lockstep_crc32, a JSON object by name), which a
// load checks for each tensor it reads: a damaged file is an error naming
// it and the tensor, as the checksums of lockstep's other files make it.
constexpr char kDcpSaveRecord[] = "lockstep_save.json";

/// Refuses a `dir` that holds another checkpoint's files: PyTorch's reader
/// takes every *.safetensors file of a folder as part of the checkpoint,
/// and its default one the folder's .metadata, so a file that no lockstep
/// save wrote would be read with the save's, or instead of it.
void check_no_other_checkpoint(const std::string& dir, const std::string& who);
/// Removes what an earlier save left that this one would not overwrite:
/// rank `rank`'s shard files; on rank 0 also the record and the files of
/// ranks at or past `world`, and lockstep's earlier index.json, which
/// load_sharded would otherwise take for this save. Makes `dir` if it is
/// missing.
void clear_dcp_save(const std::string& dir, int rank, int world, const std::string& who);
/// Rank 0, once every rank's files are written: the record, with
/// `more` (an object: the optimizer's options) beside the id and files.
void write_dcp_save_record(const std::string& dir, const std::string& save_id, const std::vector<std::string>& files,
                           const nlohmann::json& more, const std::string& who);
/// The checkpoint in `dir`, by Note [Sharded safetensors saves].
DcpCheckpoint open_dcp_save(const std::string& dir);

/// Copies box `target` of tensor `name` from the checkpoint into `dest`
/// (contiguous, of target's sizes; converted to its dtype), checking the
/// CRC-32 of each saved box it reads from.
void read_box(const DcpCheckpoint& checkpoint, const std::string& name, const Box& target, const torch::Tensor& dest);

} // namespace detail
} // namespace lockstep
