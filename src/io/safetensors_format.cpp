#include "io/safetensors_format.h"

#include "util/torch_compat.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

namespace {

using Json = nlohmann::ordered_json;

const std::vector<std::pair<std::string, c10::ScalarType>>& dtype_table() {
  static const auto table = [] {
    std::vector<std::pair<std::string, c10::ScalarType>> dtypes{
        {"F64", c10::ScalarType::Double}, {"F32", c10::ScalarType::Float},     {"F16", c10::ScalarType::Half},
        {"BF16", c10::ScalarType::BFloat16}, {"I64", c10::ScalarType::Long},   {"I32", c10::ScalarType::Int},
        {"I16", c10::ScalarType::Short},  {"I8", c10::ScalarType::Char},       {"U8", c10::ScalarType::Byte},
        {"BOOL", c10::ScalarType::Bool},  {"C64", c10::ScalarType::ComplexFloat}};
    for (auto& dtype : versioned_safetensors_dtypes()) {
      dtypes.push_back(std::move(dtype));
    }
    return dtypes;
  }();
  return table;
}

std::string known_dtypes() {
  std::string names;
  for (const auto& [name, dtype] : dtype_table()) {
    names += (names.empty() ? "" : ", ") + name;
  }
  return names;
}

// What a file that is not safetensors appears to be, from its first bytes
// ("" when nothing known): a PyTorch archive is the usual mistake, since
// torch.save's .pt and safetensors' files often lie side by side.
std::string other_format(const char* bytes, uint64_t size) {
  const auto begins_with = [&](const char* magic, size_t n) { return size >= n && std::memcmp(bytes, magic, n) == 0; };
  if (begins_with("PK\x03\x04", 4)) {
    return " It begins as a zip archive, which is what torch.save and torch::save write (a .pt file), not "
           "safetensors: give the .safetensors file, or convert the archive: a state_dict that Python's torch.save "
           "wrote with safetensors.torch.save_file(torch.load(FILE), OUT), a module that C++'s torch::save wrote "
           "with torch::load into the module and lockstep::save_safetensors.";
  }
  if (begins_with("\x80\x02\x8a\x0a", 4)) { // a pickle (protocol 2) of torch.save's magic number, a 10-byte long
    return " It begins as a Python pickle, which is what torch.save wrote before PyTorch 1.6, not safetensors: "
           "convert it in Python with safetensors.torch.save_file(torch.load(FILE), OUT).";
  }
  return "";
}

uint64_t read_length(const char* bytes) {
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | static_cast<unsigned char>(bytes[i]);
  }
  return length;
}

// The JSON text, refusing a tensor named twice or a field given twice in
// its entry (nlohmann keeps the last; Python's safetensors keeps the last
// tensor, and refuses the field). A key twice in __metadata__ is taken as
// Python takes it: the last.
Json parse_json(const std::string& text, const std::string& file) {
  std::vector<std::set<std::string>> objects; // the names of each object being read, outermost first
  std::string tensor, duplicate;              // the tensor being read; the first name given twice
  auto note_keys = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      objects.pop_back();
    } else if (event == Json::parse_event_t::key) {
      const auto name = parsed.get<std::string>();
      if (objects.size() == 1) {
        tensor = name;
      }
      const bool in_metadata = objects.size() == 2 && tensor == "__metadata__"; // Python keeps the last
      if (!in_metadata && !objects.back().insert(name).second && duplicate.empty()) {
        duplicate = objects.size() == 1 ? "names tensor '" + name + "' twice"
                                        : "gives '" + name + "' twice in the entry of '" + tensor + "'";
      }
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text, note_keys);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, file, ": the safetensors header is not valid JSON (", e.what(),
                "). The file is damaged or not a safetensors file.");
  }
  TORCH_CHECK(duplicate.empty(), file, ": the safetensors header ", duplicate, ". The file is damaged: write it "
              "again.");
  TORCH_CHECK(header.is_object(), file, ": the safetensors header is JSON but not an object of tensors.");
  return header;
}

SafetensorsMetadata parse_metadata(const Json& metadata, const std::string& file) {
  if (metadata.is_null()) { // as the Rust reader takes it: no metadata
    return {};
  }
  TORCH_CHECK(metadata.is_object(), file, ": __metadata__ is not an object of strings.");
  SafetensorsMetadata pairs;
  for (const auto& [key, value] : metadata.items()) {
    TORCH_CHECK(value.is_string(), file, ": __metadata__ entry '", key, "' is not a string.");
    pairs.emplace_back(key, value.get<std::string>());
  }
  return pairs;
}

uint64_t parse_offset(const Json& offset, const std::string& where) {
  TORCH_CHECK(offset.is_number_unsigned(), where, " has a data offset that is not a non-negative integer.");
  return offset.get<uint64_t>();
}

// One tensor's entry, its byte count checked against its shape and dtype.
SafetensorsEntry parse_entry(const std::string& name, const Json& info, const std::string& file) {
  const std::string where = file + ": tensor '" + name + "'";
  TORCH_CHECK(info.is_object() && info.contains("dtype") && info.contains("shape") && info.contains("data_offsets"),
              where, " needs \"dtype\", \"shape\" and \"data_offsets\" in the header.");
  SafetensorsEntry entry;
  entry.name = name;
  const Json& dtype = info["dtype"];
  TORCH_CHECK(dtype.is_string() && safetensors_dtype(dtype.get<std::string>(), entry.dtype), where, " has dtype ",
              dtype.dump(), ", which is not a safetensors dtype this LibTorch has (it has ", known_dtypes(), ").");
  TORCH_CHECK(info["shape"].is_array(), where, " has a shape that is not a list.");
  uint64_t numel = 1;
  for (const auto& dim : info["shape"]) {
    TORCH_CHECK(dim.is_number_unsigned() && dim.get<uint64_t>() <= uint64_t{INT64_MAX}, where, " has shape ",
                info["shape"].dump(), ": each size must be a non-negative integer.");
    entry.shape.push_back(dim.get<int64_t>());
    TORCH_CHECK(!__builtin_mul_overflow(numel, dim.get<uint64_t>(), &numel), where, " has shape ",
                info["shape"].dump(), ", too large to address.");
  }
  const Json& offsets = info["data_offsets"];
  TORCH_CHECK(offsets.is_array() && offsets.size() == 2, where, " needs data_offsets [begin, end].");
  entry.begin = parse_offset(offsets[0], where);
  entry.end = parse_offset(offsets[1], where);
  TORCH_CHECK(entry.begin <= entry.end, where, " has data_offsets [", entry.begin, ", ", entry.end,
              "], which end before they begin.");
  uint64_t bytes = 0;
  TORCH_CHECK(!__builtin_mul_overflow(numel, c10::elementSize(entry.dtype), &bytes) && bytes == entry.end - entry.begin,
              where, " has ", entry.end - entry.begin, " bytes, but its shape ", info["shape"].dump(), " of ",
              dtype.get<std::string>(), " needs ", numel, " × ", c10::elementSize(entry.dtype),
              ". The file is damaged: write it again.");
  return entry;
}

// The entries must cover the data exactly once, in some order.
void check_tiling(std::vector<const SafetensorsEntry*> entries, uint64_t data_size, const std::string& file) {
  std::sort(entries.begin(), entries.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t at = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto* entry : entries) {
    TORCH_CHECK(entry->end <= data_size, file, ": tensor '", entry->name, "' ends at byte ", entry->end,
                " of the data, but the file holds ", data_size, " bytes of data. The file is truncated: write it again.");
    TORCH_CHECK(entry->begin >= at, file, ": tensors '", previous == nullptr ? "" : previous->name, "' and '",
                entry->name, "' overlap (bytes ", entry->begin, " to ", at, " of the data). The file is damaged.");
    TORCH_CHECK(entry->begin == at, file, ": bytes ", at, " to ", entry->begin,
                " of the data belong to no tensor. The file is damaged.");
    at = entry->end;
    previous = entry;
  }
  TORCH_CHECK(at == data_size, file, ": the file holds ", data_size, " bytes of data but its tensors end at byte ", at,
              ". The file is damaged or has bytes appended.");
}

} // namespace

bool safetensors_dtype(const std::string& name, c10::ScalarType& dtype) {
  for (const auto& [known, type] : dtype_table()) {
    if (known == name) {
      dtype = type;
      return true;
    }
  }
  return false;
}

std::string safetensors_dtype_name(c10::ScalarType dtype, const std::string& what) {
  for (const auto& [name, type] : dtype_table()) {
    if (type == dtype) {
      return name;
    }
  }
  TORCH_CHECK(false, what, " has dtype ", c10::toString(dtype), ", which safetensors cannot hold (it holds ",
              known_dtypes(), "). Convert it first.");
}

SafetensorsHeader parse_safetensors(const char* bytes, uint64_t size, const std::string& file) {
  TORCH_CHECK(size >= 8, file, ": ", size, " bytes, too short for a safetensors file (its first 8 bytes are the",
              " header's length). The file is truncated or is not safetensors.");
  const uint64_t length = read_length(bytes);
  TORCH_CHECK(length <= kMaxSafetensorsHeader, file, ": the header's length is ", length,
              " bytes, more than safetensors allows (", kMaxSafetensorsHeader, "). The file is not safetensors.",
              other_format(bytes, size));
  TORCH_CHECK(length <= size - 8, file, ": the header's length is ", length, " bytes, past the end of the file (",
              size, " bytes). The file is truncated or is not safetensors.", other_format(bytes, size));
  SafetensorsHeader header;
  header.data_start = 8 + length;
  const Json json = parse_json(std::string(bytes + 8, length), file);
  std::vector<const SafetensorsEntry*> tiles;
  for (const auto& [name, info] : json.items()) {
    if (name == "__metadata__") {
      header.metadata = parse_metadata(info, file);
    } else {
      header.entries.push_back(parse_entry(name, info, file));
    }
  }
  for (const auto& entry : header.entries) {
    tiles.push_back(&entry);
  }
  check_tiling(std::move(tiles), size - header.data_start, file);
  return header;
}

std::string safetensors_header(std::vector<SafetensorsEntry>& entries, const SafetensorsMetadata& metadata) {
  std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    const size_t a_size = c10::elementSize(a.dtype);
    const size_t b_size = c10::elementSize(b.dtype);
    return a_size != b_size ? a_size > b_size : a.name < b.name;
  });
  Json json = Json::object();
  if (!metadata.empty()) {
    Json pairs = Json::object();
    for (const auto& [key, value] : metadata) {
      pairs[key] = value; // the library's own keys, added last, replace a caller's copy of them
    }
    json["__metadata__"] = std::move(pairs);
  }
  uint64_t at = 0;
  for (auto& entry : entries) {
    uint64_t numel = 1;
    for (int64_t dim : entry.shape) {
      numel *= static_cast<uint64_t>(dim);
    }
    entry.begin = at;
    entry.end = at + numel * c10::elementSize(entry.dtype);
    at = entry.end;
    json[entry.name] = {{"dtype", safetensors_dtype_name(entry.dtype, "tensor '" + entry.name + "'")},
                        {"shape", entry.shape},
                        {"data_offsets", {entry.begin, entry.end}}};
  }
  std::string text = json.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string header(8, '\0');
  for (int i = 0; i < 8; ++i) {
    header[i] = static_cast<char>((uint64_t{text.size()} >> (8 * i)) & 0xff);
  }
  return header + text;
}

} // namespace detail
} // namespace lockstep
