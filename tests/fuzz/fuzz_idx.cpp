// Fuzz target: the IDX reader (examples/idx.h), on plain and gzipped files.
// The first input byte picks images (3 dims) or labels (1), and whether the
// rest is written as it is or gzipped first, so that both of zlib's paths
// see well-formed and damaged data. An IdxError is the right answer to a bad
// file; a crash, a sanitizer report, or memory beyond what the file can fill
// (libFuzzer's -rss_limit_mb and -malloc_limit_mb) is a failure.

#include <examples/idx.h>

#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) {
    return 0;
  }
  const int dims = (data[0] & 1) != 0 ? 3 : 1;
  const bool gzipped = (data[0] & 2) != 0;
  static const std::string path = "/tmp/lockstep-fuzz-idx-" + std::to_string(::getpid());
  if (gzipped) {
    gzFile out = ::gzopen(path.c_str(), "wb");
    if (size > 1) {
      ::gzwrite(out, data + 1, static_cast<unsigned>(size - 1));
    }
    ::gzclose(out);
  } else {
    FILE* out = std::fopen(path.c_str(), "wb");
    std::fwrite(data + 1, 1, size - 1, out);
    std::fclose(out);
  }
  try {
    const auto t = lockstep::examples::read_idx(path, dims);
    // What a returned tensor promises: the header's shape, whole rows.
    if (t.dim() != dims || (dims == 3 && (t.size(1) != 28 || t.size(2) != 28))) {
      std::abort();
    }
  } catch (const lockstep::examples::IdxError&) {
  }
  return 0;
}
