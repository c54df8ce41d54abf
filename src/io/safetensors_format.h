#pragma once

// Internal: the safetensors layout (https://github.com/huggingface/safetensors,
// "Format"), parsed and written without touching tensors: an 8-byte
// little-endian header length N, N bytes of JSON padded with spaces, then the
// tensors' bytes. The JSON maps each tensor's name to its dtype, shape and
// data_offsets [begin, end) within the bytes after the header, and
// "__metadata__" to string pairs. Pure logic, fuzzed by
// tests/fuzz/fuzz_safetensors.cpp.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t begin = 0; // data_offsets, from the first byte after the header
  uint64_t end = 0;
};

using SafetensorsMetadata = std::vector<std::pair<std::string, std::string>>;

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries; // in the header's order
  SafetensorsMetadata metadata;
  uint64_t data_start = 0; // 8 + the header's length
};

/// The largest header read, as the Python package's (100 MB): a length
/// beyond it is a damaged file, not a header to allocate.
constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

/// Parses and checks the header of a whole safetensors file of `size` bytes
/// at `bytes`: every entry's dtype known, its byte count shape × element
/// size, and the entries tiling the data exactly, without overlap, gap or
/// trailing bytes (as the Python package checks). A failure is one
/// c10::Error naming `file` and the tensor.
SafetensorsHeader parse_safetensors(const char* bytes, uint64_t size, const std::string& file);

/// Sets the entries' offsets, largest element size first and then by name
/// (the Python package's order, which keeps every tensor aligned), and
/// returns the header bytes: the length, the JSON with "__metadata__" first,
/// and spaces to a multiple of 8. Returns the entries in that order.
std::string safetensors_header(std::vector<SafetensorsEntry>& entries, const SafetensorsMetadata& metadata);

/// The dtype of a safetensors dtype name; false if this LibTorch has none.
bool safetensors_dtype(const std::string& name, c10::ScalarType& dtype);
/// The safetensors name of `dtype`; an error naming `what` if it has none.
std::string safetensors_dtype_name(c10::ScalarType dtype, const std::string& what);

} // namespace detail
} // namespace lockstep
