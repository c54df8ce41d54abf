#pragma once

// Internal: rectangular boxes of a tensor, as PyTorch's distributed
// checkpoint saves a tensor's pieces (each with its offsets in every
// dimension). Pure logic, unit-tested in tests/test_boxes.cpp.

#include <cstdint>
#include <vector>

namespace lockstep {
namespace detail {

struct Box {
  std::vector<int64_t> offsets; // in each dimension of the whole tensor
  std::vector<int64_t> sizes;
  int64_t numel() const;
};

// Note [A flat shard as boxes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A FullyShardedDataParallel shard is a range of a flat buffer, and so a
// range of each parameter's elements in row-major order: it may begin and
// end in the middle of a row. PyTorch's checkpoint layout stores boxes. A
// range splits into at most 2·ndim − 1 boxes, each contiguous in the range:
// the rest of the first partial row (recursively, the rest of its partial
// sub-row first), the whole rows, then the start of the last partial row.
// So a rank writes its shard as it is, with no communication, one box of a
// tensor per file.

/// The boxes that cover elements [begin, end) of a row-major tensor of
/// `shape`, in order: box i's elements are the range's next numel() ones.
std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

/// Whether boxes `a` and `b` share any element; if so, `common` is that box.
bool intersect(const Box& a, const Box& b, Box& common);

} // namespace detail
} // namespace lockstep
