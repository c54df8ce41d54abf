#pragma once

// Internal: large transient CPU buffers that go back to the system when freed.

#include <torch/types.h>

#include <cstdint>

namespace lockstep {
namespace detail {

// Note [Pages for transient buffers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// FullyShardedDataParallel allocates and frees a unit's gathered parameters
// and its padded gradients every step, from several threads (the caller,
// autograd's, the group's). Through malloc, glibc's dynamic mmap threshold
// rises to the size of the first buffers freed, later ones come from
// per-thread arenas, and fragmentation kept up to three times DDP's resident
// memory (docs/performance.md). Mapped pages are unmapped when the tensor
// dies, so the memory that sharding saves is really returned, except for a
// small pool (32 MiB) of freed mappings that the next buffer of the same
// length takes, since every step allocates the lengths the step before did.

/// An uninitialised tensor of `numel` elements whose memory, on the CPU, is
/// its own anonymous mapping; elsewhere, torch::empty's.
torch::Tensor empty_mapped(int64_t numel, const torch::TensorOptions& options);

/// Gives `t`'s storage (which must be CPU or any device) new memory of its
/// full size: mapped pages on the CPU, the storage's allocator elsewhere.
void allocate_mapped(const torch::Tensor& t);

} // namespace detail
} // namespace lockstep
