#include "io/safetensors_file.h"

#include "util/checked_file.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <sstream>

namespace lockstep {
namespace detail {

namespace {

bool file_exists(const std::string& path) {
  struct stat status {};
  return ::stat(path.c_str(), &status) == 0 && S_ISREG(status.st_mode);
}

std::string folder_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

std::string path_of(const SafetensorsSavePlan& plan) {
  return plan.index_path.empty() ? plan.files.at(0).path : plan.index_path;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    text << (i == 0 ? "" : ", ") << shape[i];
  }
  text << "]";
  return text.str();
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    text += (text.empty() ? "\"" : ", \"") + name + "\"";
  }
  return text;
}

const std::string* metadata_value(const SafetensorsMetadata& metadata, const std::string& key) {
  for (const auto& [name, value] : metadata) {
    if (name == key) {
      return &value;
    }
  }
  return nullptr;
}

nlohmann::ordered_json read_index(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot open the safetensors index ", path, " (", std::strerror(errno), ").");
  nlohmann::ordered_json index;
  try {
    index = nlohmann::ordered_json::parse(in);
  } catch (const nlohmann::ordered_json::exception& e) {
    TORCH_CHECK(false, path, ": the safetensors index is not valid JSON (", e.what(), ").");
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object() &&
                  !index["weight_map"].empty(),
              path, ": a safetensors index needs a \"weight_map\" object of tensor names to file names, naming at "
              "least one tensor.");
  return index;
}

// An index's file name: a file beside it, never a path out of its folder.
std::string indexed_file(const std::string& index_path, const std::string& name, const nlohmann::ordered_json& file) {
  TORCH_CHECK(file.is_string(), index_path, ": tensor '", name, "' maps to ", file.dump(), ", not a file name.");
  const auto text = file.get<std::string>();
  TORCH_CHECK(!text.empty() && text.find('/') == std::string::npos && text != "." && text != "..", index_path,
              ": tensor '", name, "' maps to '", text, "', which is not the name of a file beside the index.");
  return text;
}

SafetensorsSet open_index(const std::string& index_path) {
  const auto index = read_index(index_path);
  SafetensorsSet set;
  std::map<std::string, size_t> file_numbers;
  std::map<std::string, std::string> file_of_name;
  for (const auto& [name, file] : index["weight_map"].items()) {
    const auto text = indexed_file(index_path, name, file);
    file_of_name[name] = text;
    if (file_numbers.emplace(text, set.files.size()).second) {
      set.files.push_back(open_safetensors(folder_of(index_path) + text));
    }
  }
  // Note [Safetensors save ids]: the index and its files name one save.
  std::string save_id;
  if (index.contains("metadata") && index["metadata"].is_object() && index["metadata"].contains("lockstep_save_id")) {
    save_id = index["metadata"]["lockstep_save_id"].dump();
  }
  for (const auto& [text, f] : file_numbers) {
    const auto& file = set.files[f];
    const auto* id = metadata_value(file.header.metadata, "lockstep_save_id");
    TORCH_CHECK(save_id.empty() || (id != nullptr && nlohmann::json(*id).dump() == save_id), file.path,
                " belongs to another save than its index ", index_path,
                ": a save was stopped halfway or files of two saves were mixed. Save the model again.");
    for (size_t e = 0; e < file.header.entries.size(); ++e) {
      const auto& name = file.header.entries[e].name;
      const auto mapped = file_of_name.find(name);
      TORCH_CHECK(mapped != file_of_name.end() && mapped->second == text, file.path, " holds tensor '", name,
                  "', which its index ", index_path,
                  (mapped == file_of_name.end() ? " does not name." : " maps to " + mapped->second + "."));
    }
  }
  for (const auto& [name, file] : index["weight_map"].items()) {
    const size_t f = file_numbers.at(file.get<std::string>());
    const auto& entries = set.files[f].header.entries;
    size_t e = 0;
    while (e < entries.size() && entries[e].name != name) {
      ++e;
    }
    TORCH_CHECK(e < entries.size(), index_path, " maps tensor '", name, "' to ", set.files[f].path,
                ", which does not hold it. The files and the index are of different saves.");
    set.tensors.push_back({name, f, e});
  }
  return set;
}

} // namespace

torch::Tensor SafetensorsFile::tensor(size_t i) const {
  const auto& entry = header.entries.at(i);
  const auto options = torch::TensorOptions().dtype(entry.dtype);
  if (entry.end == entry.begin) {
    return torch::empty(entry.shape, options);
  }
  char* data = bytes.get() + header.data_start + entry.begin;
  auto keep = bytes;
  auto view = torch::from_blob(data, entry.shape, [keep](void*) {}, options);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % c10::elementSize(entry.dtype) == 0;
  return aligned ? view : view.clone();
}

SafetensorsFile open_safetensors(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open the safetensors file ", path, " (", std::strerror(errno), ").");
  struct stat status {};
  const bool stated = ::fstat(fd, &status) == 0;
  const int stat_error = errno;
  SafetensorsFile file;
  file.path = path;
  file.size = stated ? static_cast<uint64_t>(status.st_size) : 0;
  void* mapped = MAP_FAILED;
  if (stated && file.size > 0) {
    mapped = ::mmap(nullptr, file.size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  }
  const int map_error = errno;
  ::close(fd);
  TORCH_CHECK(stated, "cannot read the size of ", path, " (", std::strerror(stat_error), ").");
  TORCH_CHECK(file.size == 0 || mapped != MAP_FAILED, "cannot map ", path, " (", std::strerror(map_error), ").");
  if (mapped != MAP_FAILED) {
    const uint64_t size = file.size;
    file.bytes = std::shared_ptr<char>(static_cast<char*>(mapped), [size](char* p) { ::munmap(p, size); });
  }
  static const char kEmpty[1] = {0};
  file.header = parse_safetensors(file.bytes ? file.bytes.get() : kEmpty, file.size, path);
  return file;
}

SafetensorsSet open_safetensors_set(const std::string& path) {
  if (ends_with(path, ".index.json")) {
    return open_index(path);
  }
  if (!file_exists(path) && file_exists(path + ".index.json")) {
    return open_index(path + ".index.json");
  }
  struct stat status {};
  TORCH_CHECK(::stat(path.c_str(), &status) != 0 || !S_ISDIR(status.st_mode), "cannot open the safetensors file ",
              path, ": it is a folder. Pass the file in it (", path, "/model.safetensors) or, for a model in several "
              "files, their index (", path, "/model.safetensors.index.json).");
  TORCH_CHECK(file_exists(path), "cannot open the safetensors file ", path, ": there is no such file (nor an index ",
              path, ".index.json beside it).");
  SafetensorsSet set;
  set.files.push_back(open_safetensors(path));
  const auto& entries = set.files[0].header.entries;
  for (size_t e = 0; e < entries.size(); ++e) {
    set.tensors.push_back({entries[e].name, 0, e});
  }
  return set;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

SafetensorsMetadata with_format(SafetensorsMetadata metadata) {
  if (metadata_value(metadata, "format") == nullptr) {
    metadata.insert(metadata.begin(), {"format", "pt"});
  }
  return metadata;
}

namespace {

SafetensorsFilePlan plan_file(const std::vector<SafetensorsSource>& sources, const std::vector<size_t>& members,
                              const std::string& path, const SafetensorsMetadata& metadata) {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, size_t> by_name;
  for (size_t i : members) {
    entries.push_back(sources[i].entry);
    by_name.emplace(sources[i].entry.name, i);
  }
  SafetensorsFilePlan file;
  file.path = path;
  file.header = safetensors_header(entries, metadata);
  for (const auto& entry : entries) {
    file.order.push_back(by_name.at(entry.name));
  }
  return file;
}

uint64_t byte_count(const SafetensorsEntry& entry) {
  uint64_t numel = 1;
  for (int64_t dim : entry.shape) {
    numel *= static_cast<uint64_t>(dim);
  }
  return numel * c10::elementSize(entry.dtype);
}

// Note [Safetensors save ids]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A save split into files writes them one by one under fixed names
// (model-00001-of-00003.safetensors, ...), then the index. A save stopped
// halfway, or files copied from two saves, would otherwise load as one model
// made of two. Every file's __metadata__ and the index's "metadata" carry the
// same random lockstep_save_id, and reading an index refuses a file whose id
// differs. An index without one (Hugging Face's) is read as it is.
//
// Note [One writer of replicas]: so two processes writing one path at once
// mix files of two saves, which a load refuses. A DistributedDataParallel's
// ranks hold the same weights, so rank 0 alone writes them; a
// FullyShardedDataParallel's rank 0 writes what every rank gathers.
std::string new_save_id() {
  std::random_device random;
  std::ostringstream text;
  text << std::hex << random() << random() << random() << random();
  return text.str();
}

std::string numbered_file(const std::string& stem, size_t i, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "-%05zu-of-%05zu.safetensors", i + 1, count);
  return stem + name;
}

// A name or metadata text as JSON holds it: nlohmann's dump throws on bytes
// that are not UTF-8, after files may have been removed, so they are
// refused here, with the bytes shown.
void check_utf8(const std::string& text, const char* what, const std::string& who) {
  try {
    (void)nlohmann::json(text).dump();
  } catch (const nlohmann::json::type_error&) {
    std::string shown;
    for (unsigned char c : text) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      shown += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : std::string(escaped);
    }
    TORCH_CHECK(false, who, ": the ", what, " '", shown, "' is not valid UTF-8, which a safetensors header (JSON) "
                "needs. Rename it.");
  }
}

} // namespace

SafetensorsSavePlan plan_safetensors_save(const std::vector<SafetensorsSource>& sources, const std::string& path,
                                          const SafetensorsSaveOptions& options, const std::string& who) {
  std::map<std::string, size_t> names;
  std::vector<std::vector<size_t>> groups(1);
  uint64_t total = 0, in_group = 0;
  const auto limit = static_cast<uint64_t>(options.max_shard_bytes());
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& name = sources[i].entry.name;
    TORCH_CHECK(!name.empty() && name != "__metadata__", who, ": '", name, "' cannot name a tensor in safetensors.");
    TORCH_CHECK(names.emplace(name, i).second, who, ": two tensors are named '", name, "'.");
    check_utf8(name, "tensor name", who);
    const uint64_t bytes = byte_count(sources[i].entry);
    if (limit > 0 && in_group > 0 && in_group + bytes > limit) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(i);
    in_group += bytes;
    total += bytes;
  }
  for (const auto& [key, value] : options.metadata()) {
    check_utf8(key, "metadata key", who);
    check_utf8(value, "metadata value", who);
  }
  SafetensorsSavePlan plan;
  if (groups.size() == 1) {
    plan.files.push_back(plan_file(sources, groups[0], path, with_format(options.metadata())));
    plan.superseded = path + ".index.json";
    return plan;
  }
  TORCH_CHECK(ends_with(path, ".safetensors"), who, ": ", path, " must end in .safetensors to be split into files",
              " (model.safetensors becomes model-00001-of-00002.safetensors, ... and model.safetensors.index.json).");
  const std::string stem = path.substr(0, path.size() - std::string(".safetensors").size());
  const std::string id = new_save_id();
  auto metadata = with_format(options.metadata());
  metadata.emplace_back("lockstep_save_id", id);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t g = 0; g < groups.size(); ++g) {
    plan.files.push_back(plan_file(sources, groups[g], numbered_file(stem, g, groups.size()), metadata));
    const auto file = plan.files.back().path.substr(folder_of(path).size());
    for (size_t i : groups[g]) {
      weight_map[sources[i].entry.name] = file;
    }
  }
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total}, {"lockstep_save_id", id}}},
                                  {"weight_map", std::move(weight_map)}};
  plan.index_path = path + ".index.json";
  plan.index = index.dump(2) + "\n";
  plan.superseded = path;
  return plan;
}

torch::Tensor host_bytes(const torch::Tensor& tensor) {
  torch::NoGradGuard no_grad;
  return tensor.detach().to(torch::kCPU).resolve_conj().resolve_neg().contiguous();
}

void check_has_bytes(const torch::Tensor& tensor, const std::string& what) {
  TORCH_CHECK(tensor.layout() == torch::kStrided, what, " is ", tensor.layout(), ", and safetensors holds dense "
              "tensors only: save its .to_dense().");
  TORCH_CHECK(!tensor.is_meta(), what, " is on the meta device and has no values yet (a module made with deferred "
              "initialisation): initialise it, or move it to a device, before saving.");
}

void write_safetensors_save(const SafetensorsSavePlan& plan, const std::vector<SafetensorsSource>& sources,
                            const std::string& who) {
  for (const auto& file : plan.files) {
    write_file_atomically(
        file.path,
        [&](std::ostream& out) {
          out.write(file.header.data(), static_cast<std::streamsize>(file.header.size()));
          for (size_t i : file.order) {
            const torch::Tensor bytes = sources[i].bytes();
            TORCH_INTERNAL_ASSERT(bytes.is_contiguous() && bytes.device().is_cpu());
            TORCH_INTERNAL_ASSERT(!bytes.is_conj() && !bytes.is_neg()); // host_bytes resolved them
            TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(bytes.nbytes()) == byte_count(sources[i].entry));
            out.write(static_cast<const char*>(bytes.data_ptr()), static_cast<std::streamsize>(bytes.nbytes()));
          }
        },
        who);
  }
  if (!plan.index_path.empty()) {
    write_file_atomically(
        plan.index_path, [&](std::ostream& out) { out << plan.index; }, who);
  }
  if (file_exists(plan.superseded)) {
    TORCH_CHECK(std::remove(plan.superseded.c_str()) == 0, who, ": saved to ", path_of(plan),
                ", but cannot remove the earlier save's ", plan.superseded, " (", std::strerror(errno),
                "), which a load would read instead. Remove it.");
  }
}

// Note [Tied parameters in safetensors files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// safetensors' save_model writes a tensor that a module holds under two
// names (an embedding tied to the output layer) under one of them, and so
// do Hugging Face's save_pretrained and its files; its load_model, strict,
// takes such a file: a name is not missing where another name of the same
// tensor is in the file (_remove_duplicate_names). So does this load. Names
// only of the same view of the same memory count as one: copying into one
// of them sets them all.
std::vector<size_t> same_tensors(const std::vector<torch::Tensor>& tensors) {
  std::vector<size_t> same_as(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    same_as[i] = i;
    for (size_t k = 0; k < i && tensors[i].numel() > 0; ++k) {
      if (tensors[k].data_ptr() == tensors[i].data_ptr() && tensors[k].sizes() == tensors[i].sizes() &&
          tensors[k].strides() == tensors[i].strides() && tensors[k].dtype() == tensors[i].dtype() &&
          tensors[k].device() == tensors[i].device()) {
        same_as[i] = same_as[k];
        break;
      }
    }
  }
  return same_as;
}

namespace {

// Note [Tied parameters in safetensors files]: a name missing from the file
// is not missing where another name of the same tensor was found.
void drop_tied_names(std::vector<std::string>& missing, const StateMatch& match,
                     const std::map<std::string, size_t>& in_module, const std::vector<size_t>& same_as) {
  if (same_as.empty()) {
    return;
  }
  std::set<size_t> loaded;
  for (const auto& pair : match.pairs) {
    loaded.insert(same_as[pair.first]);
  }
  missing.erase(std::remove_if(missing.begin(), missing.end(),
                               [&](const std::string& name) { return loaded.count(same_as[in_module.at(name)]) != 0; }),
                missing.end());
}

// What to do about names that do not match: the prefix "module." that a
// Python DistributedDataParallel's or DataParallel's state_dict() gives
// every name, or, where `partial`, a load that is not strict.
std::string how_to_match(const std::vector<std::string>& unexpected, const std::map<std::string, size_t>& in_module,
                         bool partial) {
  const std::string prefix = "module.";
  const bool wrapped = !unexpected.empty() && std::all_of(unexpected.begin(), unexpected.end(), [&](const auto& name) {
    return name.compare(0, prefix.size(), prefix) == 0 && in_module.count(name.substr(prefix.size())) != 0;
  });
  if (wrapped) {
    return "\nThe file's names carry the prefix \"module.\" of a Python DistributedDataParallel's (or "
           "DataParallel's) state_dict(): save model.module.state_dict() in Python, or read the file with "
           "lockstep::read_safetensors and load the tensors under the names without it.";
  }
  return partial ? "\nSafetensorsLoadOptions().strict(false) loads the names that match and leaves the rest." : "";
}

// What a conversion keeps: float to int truncates, complex to real drops a part.
enum class DtypeKind { kFloating, kIntegral, kComplex, kBool };

DtypeKind kind_of(torch::ScalarType dtype) {
  if (dtype == torch::kBool) {
    return DtypeKind::kBool;
  }
  if (c10::isComplexType(dtype)) {
    return DtypeKind::kComplex;
  }
  return c10::isFloatingType(dtype) ? DtypeKind::kFloating : DtypeKind::kIntegral;
}

} // namespace

torch::Tensor read_as(const SafetensorsSet& set, const SafetensorsSet::Where& where, torch::ScalarType dtype,
                      const std::string& file) {
  const auto stored = set.files[where.file].tensor(where.entry);
  if (stored.scalar_type() == dtype) {
    return stored;
  }
  const auto converted = stored.to(dtype);
  // A value the file holds finitely must stay finite (F32 into F16 turns
  // 1e5 into inf, into F8_E4M3 into NaN), and an integer must fit (I64
  // into I32 wraps).
  const bool integral = kind_of(dtype) == DtypeKind::kIntegral;
  const auto lost = integral ? converted.to(stored.scalar_type()).ne(stored)
                             : torch::isfinite(stored).logical_and(torch::isfinite(converted).logical_not());
  const int64_t count = lost.sum().item<int64_t>();
  if (count == 0) {
    return converted;
  }
  const auto first = stored.masked_select(lost)[0];
  std::ostringstream shown; // a complex value by its size
  if (integral) {
    shown << first.item<int64_t>();
  } else {
    shown << (c10::isComplexType(dtype) ? torch::abs(first) : first).item<double>();
  }
  TORCH_CHECK(false, "lockstep::load_safetensors(", file, "): ", where.name, ": ", count, " of its ", stored.numel(),
              " values (the first: ", shown.str(), ") do not fit in ", c10::toString(dtype), ", the model's dtype, "
              "when converted from the file's ", c10::toString(stored.scalar_type()), "; give the model the file's "
              "dtype (or a wider one).");
}

StateMatch match_state(const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
                       const std::vector<torch::ScalarType>& dtypes, const SafetensorsSet& set,
                       const SafetensorsLoadOptions& options, const std::string& file,
                       const std::vector<size_t>& same_as) {
  TORCH_INTERNAL_ASSERT(same_as.empty() || same_as.size() == names.size());
  std::map<std::string, const SafetensorsSet::Where*> in_file;
  for (const auto& where : set.tensors) {
    in_file.emplace(where.name, &where);
  }
  StateMatch match;
  std::vector<std::string> missing, unexpected, mismatches;
  std::map<std::string, size_t> in_module;
  for (size_t i = 0; i < names.size(); ++i) {
    in_module.emplace(names[i], i);
    const auto found = in_file.find(names[i]);
    if (found == in_file.end()) {
      missing.push_back(names[i]);
      continue;
    }
    const auto& entry = set.entry(*found->second);
    if (entry.shape != shapes[i]) {
      mismatches.push_back("size mismatch for " + names[i] + ": copying a param with shape " + shape_text(entry.shape) +
                           " from checkpoint, the shape in current model is " + shape_text(shapes[i]) + ".");
    } else if (entry.dtype != dtypes[i] && !options.convert_dtypes()) {
      mismatches.push_back(std::string("dtype mismatch for ") + names[i] + ": the file has " +
                           c10::toString(entry.dtype) + ", the model " + c10::toString(dtypes[i]) +
                           " (SafetensorsLoadOptions().convert_dtypes(true) converts it).");
    } else if (entry.dtype != dtypes[i] && kind_of(entry.dtype) != kind_of(dtypes[i])) {
      mismatches.push_back(std::string("dtype mismatch for ") + names[i] + ": the file has " +
                           c10::toString(entry.dtype) + ", the model " + c10::toString(dtypes[i]) + ", and "
                           "convert_dtypes(true) converts only between floating-point dtypes, between complex "
                           "ones or between integer ones: give the model the file's dtype.");
    }
    match.pairs.emplace_back(i, found->second);
  }
  for (const auto& where : set.tensors) {
    if (in_module.count(where.name) == 0) {
      unexpected.push_back(where.name);
    }
  }
  drop_tied_names(missing, match, in_module, same_as);
  std::string errors;
  if (options.strict() && !missing.empty()) {
    errors += "\n\tMissing key(s) in state_dict: " + quoted_list(missing) + ".";
  }
  if (options.strict() && !unexpected.empty()) {
    errors += "\n\tUnexpected key(s) in state_dict: " + quoted_list(unexpected) + ".";
  }
  for (const auto& mismatch : mismatches) {
    errors += "\n\t" + mismatch;
  }
  TORCH_CHECK(errors.empty(), "Error(s) in loading ", file, " (nothing was loaded):", errors,
              how_to_match(unexpected, in_module,
                           options.strict() && !match.pairs.empty() && (!missing.empty() || !unexpected.empty())));
  if (match.pairs.empty() && !set.tensors.empty() && !names.empty()) { // as load_state_dict(strict=False), but said
    TORCH_WARN("lockstep: ", file, " holds none of the module's ", names.size(), " names, so nothing was loaded "
               "(the file's first is \"", set.tensors.front().name, "\", the module's \"", names.front(), "\").",
               how_to_match(unexpected, in_module, false));
  }
  return match;
}

} // namespace detail
} // namespace lockstep
