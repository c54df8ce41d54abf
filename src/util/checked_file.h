#pragma once

// Internal, shared with the trainer (examples/checkpoint.h): files that are
// written atomically and read back only when whole. A file is `magic`, the
// payload's length (8 bytes, little-endian), its CRC-32 (4 bytes, zlib's),
// then the payload (src/util/checked_file.cpp).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>

namespace lockstep {
namespace detail {

/// zlib's CRC-32 of `size` bytes, in chunks that zlib's uInt can count.
uint32_t crc32_of(const char* data, size_t size);

/// Whether `size` bytes have the CRC-32 `expected`. One function, so that
/// the fuzz build can compile it without libFuzzer's comparison tracing,
/// which would otherwise copy the right checksum into damaged inputs and
/// feed them to LibTorch's reader (tests/fuzz/CMakeLists.txt).
bool crc32_matches(const char* data, size_t size, uint32_t expected);

/// Calls `write` on a temporary file beside `path`, syncs it, renames it to
/// `path`, and syncs the folder: `path` is the old file or the whole new one,
/// never part of it. Errors start with `who`.
void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write,
                           const std::string& who);

/// `magic`, length, CRC-32 and `payload` to a temporary file beside `path`,
/// synced, renamed to `path`, and the folder synced. Errors start with `who`.
void write_checked_file(const std::string& path, const std::string& magic, const std::string& payload,
                        const std::string& who);

/// Removes `path` and, if it is a folder, everything in it, without following
/// links. Whether nothing is left there. Use it, not
/// std::filesystem::remove_all: Note [The wheel's std::filesystem].
bool remove_tree(const std::string& path);

} // namespace detail
} // namespace lockstep
