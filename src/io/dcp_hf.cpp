#include "io/dcp_hf.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "util/checked_file.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace lockstep {
namespace detail {

namespace {

constexpr char kShardingInfo[] = "DCP_SHARDING_INFO";
constexpr char kChecksums[] = "lockstep_crc32";

uint32_t crc_of(const torch::Tensor& tensor) {
  const auto bytes = host_bytes(tensor);
  return crc32_of(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
}

std::vector<int64_t> offsets_of(const nlohmann::json& info, const std::string& where) {
  TORCH_CHECK(info.is_object() && info.contains("saved_offsets") && info["saved_offsets"].is_array(), where,
              " has no \"saved_offsets\" list in DCP_SHARDING_INFO.");
  std::vector<int64_t> offsets;
  for (const auto& offset : info["saved_offsets"]) {
    TORCH_CHECK(offset.is_number_unsigned(), where, ": a saved offset is not a non-negative integer.");
    offsets.push_back(offset.get<int64_t>());
  }
  return offsets;
}

// The JSON object in one file's __metadata__[key], parsed: {} for a file
// without it (a plain Hugging Face file, whose tensors are whole and carry
// no checksums).
nlohmann::json metadata_object(const SafetensorsFile& file, const char* key) {
  for (const auto& [name, value] : file.header.metadata) {
    if (name == key) {
      try {
        auto info = nlohmann::json::parse(value);
        TORCH_CHECK(info.is_object(), file.path, ": ", key, " is not a JSON object.");
        return info;
      } catch (const nlohmann::json::exception& e) {
        TORCH_CHECK(false, file.path, ": ", key, " is not valid JSON (", e.what(), ").");
      }
    }
  }
  return nlohmann::json::object();
}

void add_boxes(DcpCheckpoint& checkpoint, size_t f) {
  const auto& file = checkpoint.files[f];
  const auto info = metadata_object(file, kShardingInfo);
  const auto checksums = metadata_object(file, kChecksums);
  for (size_t e = 0; e < file.header.entries.size(); ++e) {
    const auto& entry = file.header.entries[e];
    const std::string where = file.path + ": tensor '" + entry.name + "'";
    std::optional<uint32_t> crc;
    if (!checksums.empty()) {
      TORCH_CHECK(checksums.contains(entry.name) && checksums[entry.name].is_number_unsigned(), where,
                  " has no checksum in lockstep_crc32: the file is damaged. Load an earlier checkpoint, or save again.");
      crc = checksums[entry.name].get<uint32_t>();
    }
    Box box;
    box.sizes = entry.shape;
    if (info.empty()) {
      box.offsets.assign(entry.shape.size(), 0);
    } else {
      TORCH_CHECK(info.contains(entry.name), where, " has no entry in DCP_SHARDING_INFO.");
      box.offsets = offsets_of(info[entry.name], where);
      TORCH_CHECK(box.offsets.size() == box.sizes.size(), where, " has ", box.offsets.size(), " saved offsets for ",
                  box.sizes.size(), " dimensions.");
    }
    auto& dtype = checkpoint.dtypes.emplace(entry.name, entry.dtype).first->second;
    TORCH_CHECK(dtype == entry.dtype, where, " is ", c10::toString(entry.dtype), ", but another box of it is ",
                c10::toString(dtype), ".");
    auto& boxes = checkpoint.boxes[entry.name];
    const bool again = std::any_of(boxes.begin(), boxes.end(), [&](const auto& saved) {
      return saved.box.offsets == box.offsets && saved.box.sizes == box.sizes;
    });
    if (!again) { // a replicated tensor may be saved by several ranks
      boxes.push_back({f, e, std::move(box), crc});
    }
  }
}

// Each tensor's shape, the largest offset + size over its boxes, which the
// boxes must tile exactly: their elements add up to its own, none overlap.
void check_tiling(DcpCheckpoint& checkpoint) {
  for (auto& [name, boxes] : checkpoint.boxes) {
    std::vector<int64_t> shape(boxes[0].box.sizes.size(), 0);
    int64_t saved = 0;
    for (const auto& one : boxes) {
      TORCH_CHECK(one.box.sizes.size() == shape.size(), checkpoint.dir, ": the boxes of tensor '", name,
                  "' differ in their number of dimensions.");
      for (size_t d = 0; d < shape.size(); ++d) {
        shape[d] = std::max(shape[d], one.box.offsets[d] + one.box.sizes[d]);
      }
      saved += one.box.numel();
    }
    int64_t numel = 1;
    for (int64_t size : shape) {
      numel *= size;
    }
    for (size_t i = 0; i < boxes.size(); ++i) {
      for (size_t j = i + 1; j < boxes.size(); ++j) {
        Box common;
        TORCH_CHECK(!intersect(boxes[i].box, boxes[j].box, common) || common.numel() == 0, checkpoint.dir,
                    ": two boxes of tensor '", name, "' overlap (in ", checkpoint.files[boxes[i].file].path, " and ",
                    checkpoint.files[boxes[j].file].path, "): the folder mixes files of two saves.");
      }
    }
    TORCH_CHECK(saved == numel, checkpoint.dir, ": the boxes of tensor '", name, "' hold ", saved, " of its ", numel,
                " elements: a file of the save is missing.");
    checkpoint.shapes[name] = shape;
  }
}

} // namespace

std::string dcp_file_name(int rank, size_t k, size_t n) {
  char name[96];
  std::snprintf(name, sizeof(name), "shard-%05d-model-%05zu-of-%05zu.safetensors", rank + 1, k + 1, n);
  return name;
}

int dcp_file_rank_number(const std::string& name) {
  int number = 0;
  char rest[64] = {0};
  if (std::sscanf(name.c_str(), "shard-%5d-model-%63s", &number, rest) != 2 || !ends_with(name, ".safetensors")) {
    return 0;
  }
  return number;
}

std::vector<std::string> write_dcp_boxes(const std::string& dir, int rank, const std::vector<BoxSource>& boxes,
                                         const SafetensorsMetadata& metadata, const std::string& who) {
  std::vector<std::vector<size_t>> files; // file k: the k-th box of each tensor
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const size_t k = seen[boxes[i].name]++;
    if (files.size() <= k) {
      files.resize(k + 1);
    }
    files[k].push_back(i);
  }
  std::vector<std::string> names;
  for (size_t k = 0; k < files.size(); ++k) {
    std::vector<SafetensorsSource> sources;
    nlohmann::json info = nlohmann::json::object();
    nlohmann::json checksums = nlohmann::json::object();
    for (size_t i : files[k]) {
      const auto& box = boxes[i];
      const auto bytes = box.bytes(); // a piece of this rank's shard: held until the file is written
      sources.push_back({{box.name, box.dtype, box.box.sizes, 0, 0}, [bytes] { return bytes; }});
      info[box.name] = {{"saved_offsets", box.box.offsets}};
      checksums[box.name] = crc_of(bytes);
    }
    auto file_metadata = metadata;
    file_metadata.emplace_back(kShardingInfo, info.dump());
    file_metadata.emplace_back(kChecksums, checksums.dump());
    file_metadata.emplace_back("DCP_VERSION", "1.0");
    names.push_back(dcp_file_name(rank, k, files.size()));
    const auto plan = plan_safetensors_save(sources, dir + "/" + names.back(),
                                            SafetensorsSaveOptions().metadata(file_metadata), who);
    write_safetensors_save({plan.files, "", "", ""}, sources, who);
  }
  return names;
}

std::vector<std::string> safetensors_in(const std::string& dir) {
  DIR* folder = ::opendir(dir.c_str());
  TORCH_CHECK(folder != nullptr, "cannot read the checkpoint folder ", dir, " (", std::strerror(errno), ").");
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(folder)) {
    const std::string name = entry->d_name;
    if (name.size() > 12 && ends_with(name, ".safetensors")) {
      names.push_back(name);
    }
  }
  ::closedir(folder);
  std::sort(names.begin(), names.end());
  return names;
}

DcpCheckpoint open_dcp(const std::string& dir, const std::vector<std::string>& files) {
  DcpCheckpoint checkpoint;
  checkpoint.dir = dir;
  const auto names = files.empty() ? safetensors_in(dir) : files;
  if (names.empty()) {
    struct stat metadata {};
    TORCH_CHECK(::stat((dir + "/.metadata").c_str(), &metadata) != 0, dir, " holds PyTorch's default distributed "
                "checkpoint (.metadata and .distcp files), which lockstep does not read. Save the checkpoint with "
                "torch.distributed.checkpoint's HuggingFaceStorageWriter(dir, save_distributed=True) instead.");
    TORCH_CHECK(false, dir, " holds no .safetensors file: it is not a checkpoint folder.");
  }
  for (const auto& name : names) {
    checkpoint.files.push_back(open_safetensors(dir + "/" + name));
    add_boxes(checkpoint, checkpoint.files.size() - 1);
  }
  check_tiling(checkpoint);
  return checkpoint;
}

void check_no_other_checkpoint(const std::string& dir, const std::string& who) {
  DIR* folder = ::opendir(dir.c_str());
  if (folder == nullptr) {
    return; // the write names the folder
  }
  std::string other;
  while (const dirent* entry = ::readdir(folder)) {
    const std::string name = entry->d_name;
    const bool safetensors = ends_with(name, ".safetensors") && dcp_file_rank_number(name) == 0;
    if (other.empty() && (safetensors || name == ".metadata" || ends_with(name, ".distcp"))) {
      other = name;
    }
  }
  ::closedir(folder);
  TORCH_CHECK(other.empty(), who, ": ", dir, " holds ", other, ", which is not a file of a lockstep save. PyTorch's "
              "readers read every such file of a checkpoint's folder, so the save would mix with it. Save into an "
              "empty folder, or remove ", dir, "/", other, " first.");
}

void clear_dcp_save(const std::string& dir, int rank, int world, const std::string& who) {
  // `dir` and the folders above it, as PyTorch's writer makes them; an
  // existing one, or one that cannot be made: the next step says which.
  for (size_t slash = dir.find('/', 1); slash != std::string::npos; slash = dir.find('/', slash + 1)) {
    ::mkdir(dir.substr(0, slash).c_str(), 0777);
  }
  ::mkdir(dir.c_str(), 0777);
  if (rank == 0) {
    for (const std::string& record : {dir + "/" + kDcpSaveRecord, dir + "/index.json"}) {
      TORCH_CHECK(std::remove(record.c_str()) == 0 || errno == ENOENT, who, ": cannot remove the earlier save's ",
                  record, " (", std::strerror(errno), ").");
    }
  }
  for (const auto& name : safetensors_in(dir)) {
    const int number = dcp_file_rank_number(name);
    if (number == rank + 1 || (rank == 0 && number > world)) {
      const std::string path = dir + "/" + name;
      TORCH_CHECK(std::remove(path.c_str()) == 0 || errno == ENOENT, who, ": cannot remove the earlier save's ", path,
                  " (", std::strerror(errno), ").");
    }
  }
}

void write_dcp_save_record(const std::string& dir, const std::string& save_id, const std::vector<std::string>& files,
                           const nlohmann::json& more, const std::string& who) {
  nlohmann::json record = {{"format", "pytorch-dcp-huggingface"}, {"lockstep_save_id", save_id}, {"files", files}};
  record.update(more);
  write_file_atomically(
      dir + "/" + kDcpSaveRecord, [&](std::ostream& out) { out << record.dump(1) << "\n"; }, who);
}

namespace {

const std::string* save_id_of(const SafetensorsFile& file) {
  for (const auto& [key, value] : file.header.metadata) {
    if (key == "lockstep_save_id") {
      return &value;
    }
  }
  return nullptr;
}

} // namespace

DcpCheckpoint open_dcp_save(const std::string& dir) {
  const std::string record_path = dir + "/" + kDcpSaveRecord;
  std::ifstream in(record_path);
  if (!in) {
    auto checkpoint = open_dcp(dir, {});
    for (const auto& file : checkpoint.files) {
      TORCH_CHECK(save_id_of(file) == nullptr, file.path, " was written by a lockstep save that did not finish: ",
                  record_path, ", which a save writes last, is missing. Load an earlier checkpoint, or save again.");
    }
    return checkpoint;
  }
  nlohmann::json record;
  try {
    record = nlohmann::json::parse(in);
    record.at("files").get<std::vector<std::string>>();
    record.at("lockstep_save_id").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, record_path, " is damaged (", e.what(), "). Load an earlier checkpoint, or save again.");
  }
  for (const auto& name : record["files"].get<std::vector<std::string>>()) {
    TORCH_CHECK(dcp_file_rank_number(name) > 0 && name.find('/') == std::string::npos, record_path, " names '", name,
                "', which is not a shard file of a lockstep save in its folder. The record is damaged: load an "
                "earlier checkpoint, or save again.");
  }
  const auto id = record["lockstep_save_id"].get<std::string>();
  auto checkpoint = open_dcp(dir, record["files"].get<std::vector<std::string>>());
  checkpoint.record = std::move(record);
  for (const auto& file : checkpoint.files) {
    const auto* theirs = save_id_of(file);
    TORCH_CHECK(theirs != nullptr && *theirs == id, file.path, " belongs to another save than ", record_path,
                ": the folder mixes files of two saves. Load an earlier checkpoint, or save again.");
  }
  return checkpoint;
}

void read_box(const DcpCheckpoint& checkpoint, const std::string& name, const Box& target, const torch::Tensor& dest) {
  const auto found = checkpoint.boxes.find(name);
  TORCH_INTERNAL_ASSERT(found != checkpoint.boxes.end());
  for (const auto& saved : found->second) {
    Box common;
    if (!intersect(saved.box, target, common) || common.numel() == 0) {
      continue;
    }
    auto source = checkpoint.files[saved.file].tensor(saved.entry);
    TORCH_CHECK(!saved.crc || crc_of(source) == *saved.crc, checkpoint.files[saved.file].path, ": tensor '", name,
                "' is damaged: its checksum does not match its content. Restore the file from a copy, or load an "
                "earlier checkpoint.");
    auto into = dest;
    for (size_t d = 0; d < common.offsets.size(); ++d) {
      source = source.narrow(static_cast<int64_t>(d), common.offsets[d] - saved.box.offsets[d], common.sizes[d]);
      into = into.narrow(static_cast<int64_t>(d), common.offsets[d] - target.offsets[d], common.sizes[d]);
    }
    into.copy_(source);
  }
}

} // namespace detail
} // namespace lockstep
