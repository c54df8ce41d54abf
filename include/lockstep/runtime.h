#pragma once

#include <string>

namespace lockstep {

/// The paths of the BLAS libraries this process loaded, comma-separated, or ""
/// if none is mapped (read from /proc/self/maps).
std::string loaded_blas();

/// Throws a c10::Error if this process runs on Debian's reference BLAS, which
/// is about 20x slower for matrix products than OpenBLAS. `who` names the
/// caller in the message. Benchmarks and the trainer call it first.
void require_fast_blas(const std::string& who);

} // namespace lockstep
