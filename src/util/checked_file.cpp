#include "util/checked_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace lockstep {
namespace detail {

namespace {

// A write the disk refused can surface only at fsync (NFS, quotas, a disk
// full under delayed allocation): a file whose sync failed must not be
// renamed into place. A folder's sync may be unsupported (EINVAL), which
// loses nothing that was written.
void sync_path(const std::string& path, int flags, const std::string& who) {
  const int fd = ::open(path.c_str(), flags);
  TORCH_CHECK(fd >= 0, who, ": cannot open ", path, " to sync it to disk (", std::strerror(errno), ").");
  const bool synced = ::fsync(fd) == 0 || ((flags & O_DIRECTORY) != 0 && errno == EINVAL);
  const int sync_error = errno;
  const bool closed = ::close(fd) == 0;
  TORCH_CHECK(synced && closed, who, ": cannot write ", path, " to disk (", std::strerror(synced ? errno : sync_error),
              "). Free space on the disk, or write elsewhere.");
}

} // namespace

uint32_t crc32_of(const char* data, size_t size) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (size_t at = 0; at < size; at += size_t{1} << 30) {
    const auto chunk = static_cast<uInt>(std::min(size - at, size_t{1} << 30));
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(data + at), chunk);
  }
  return static_cast<uint32_t>(crc);
}

bool crc32_matches(const char* data, size_t size, uint32_t expected) {
  return crc32_of(data, size) == expected;
}

void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write,
                           const std::string& who) {
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  // A write that fails leaves no partial temporary file behind: on a full
  // disk it would hold the space the next save needs.
  try {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.is_open(), who, ": cannot create ", temporary, " (", std::strerror(errno), ").");
    write(out);
    out.close();
    TORCH_CHECK(!out.fail(), who, ": cannot write ", temporary, " (", std::strerror(errno), ").");
    sync_path(temporary, O_RDONLY, who);
    TORCH_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, who, ": cannot rename ", temporary, " to ", path,
                " (", std::strerror(errno), ").");
  } catch (...) {
    std::remove(temporary.c_str());
    throw;
  }
  const auto slash = path.find_last_of('/');
  sync_path(slash == std::string::npos ? "." : path.substr(0, slash + 1), O_RDONLY | O_DIRECTORY, who);
}

void write_checked_file(const std::string& path, const std::string& magic, const std::string& payload,
                        const std::string& who) {
  std::string header = magic;
  const uint64_t length = payload.size();
  const uint32_t crc = crc32_of(payload.data(), payload.size());
  for (int i = 0; i < 8; ++i) {
    header += static_cast<char>((length >> (8 * i)) & 0xff);
  }
  for (int i = 0; i < 4; ++i) {
    header += static_cast<char>((crc >> (8 * i)) & 0xff);
  }
  write_file_atomically(
      path,
      [&](std::ostream& out) {
        out.write(header.data(), static_cast<std::streamsize>(header.size()));
        out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
      },
      who);
}

// Note [The wheel's std::filesystem]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's pip wheels export copies of libstdc++'s std::filesystem from
// their libtorch libraries. A program lists libtorch before libstdc++, so the
// dynamic linker binds the program's own std::filesystem calls to those
// copies, not to the libstdc++ its headers belong to. With the 2.11 wheel on a
// GPU machine (Ubuntu 24.04, GCC 13), libtorch.so's remove_all of a folder
// with files in it called address 0: the trainer died saving its second
// sharded checkpoint, and two tests with it. Naming libstdc++ first on the
// link line fixed the binding with Debian's toolchain but not with that
// machine's, so lockstep, its programs and its tests remove folders with
// nftw instead. The other std::filesystem calls they make ran there.
namespace {

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

} // namespace

bool remove_tree(const std::string& path) {
  struct stat status {};
  if (::lstat(path.c_str(), &status) != 0) {
    return errno == ENOENT;
  }
  constexpr int kOpenFolders = 16;
  return ::nftw(path.c_str(), remove_entry, kOpenFolders, FTW_DEPTH | FTW_PHYS) == 0;
}

} // namespace detail
} // namespace lockstep
