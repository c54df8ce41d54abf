// Fuzz target: the safetensors header parser (src/io/safetensors_format.h),
// on the whole input as a file. A c10::Error is the right answer to a bad
// file; a crash or a sanitizer report is a failure, and so is a header it
// accepts whose entries do not tile the data exactly, or whose byte counts
// disagree with their shapes, since the reader then maps tensors over them.

#include "io/safetensors_format.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto header =
        lockstep::detail::parse_safetensors(reinterpret_cast<const char*>(data), size, "fuzz.safetensors");
    uint64_t bytes = 0;
    for (const auto& entry : header.entries) {
      const uint64_t numel = c10::multiply_integers(entry.shape);
      if (entry.end - entry.begin != numel * c10::elementSize(entry.dtype) || header.data_start + entry.end > size) {
        std::abort();
      }
      bytes += entry.end - entry.begin;
    }
    if (header.data_start + bytes != size) {
      std::abort();
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
