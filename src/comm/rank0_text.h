#pragma once

// Internal: rank 0's words on every rank, for the checks at construction
// that name what differs between the ranks' models (DistributedDataParallel,
// FullyShardedDataParallel), not only that something does.

#include <lockstep/process_group.h>

#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// Rank 0's `text`, on every rank (a collective): its length, then its
/// bytes, broadcast over `device` (a CUDA device for NCCL), named `what`.
std::string rank0_text(const ProcessGroup& group, const std::string& text, torch::Device device,
                       const std::string& what);

/// `text`'s lines, without their newlines.
std::vector<std::string> split_lines(const std::string& text);

} // namespace detail
} // namespace lockstep
