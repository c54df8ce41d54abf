#include "io/boxes.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace lockstep {
namespace detail {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t size : sizes) {
    n *= size;
  }
  return n;
}

namespace {

// Elements [begin, end) of the sub-tensor at dimension `dim`, whose leading
// offsets (dimensions before `dim`, each of size 1) are `prefix`.
void split(const std::vector<int64_t>& shape, size_t dim, std::vector<int64_t> prefix, int64_t begin, int64_t end,
           std::vector<Box>& out) {
  if (begin >= end) {
    return;
  }
  int64_t inner = 1; // elements per index of `dim`
  for (size_t d = dim + 1; d < shape.size(); ++d) {
    inner *= shape[d];
  }
  auto box = [&](int64_t first, int64_t count) {
    Box b;
    b.offsets = prefix;
    b.offsets.push_back(first);
    b.sizes.assign(prefix.size(), 1);
    b.sizes.push_back(count);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      b.offsets.push_back(0);
      b.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(b));
  };
  const int64_t first_whole = (begin + inner - 1) / inner;
  const int64_t end_whole = end / inner;
  if (first_whole > end_whole) { // within one index: a partial sub-tensor
    const int64_t index = begin / inner;
    prefix.push_back(index);
    split(shape, dim + 1, std::move(prefix), begin - index * inner, end - index * inner, out);
    return;
  }
  if (begin < first_whole * inner) {
    auto head = prefix;
    head.push_back(first_whole - 1);
    split(shape, dim + 1, std::move(head), begin - (first_whole - 1) * inner, inner, out);
  }
  if (first_whole < end_whole) {
    box(first_whole, end_whole - first_whole);
  }
  if (end_whole * inner < end) {
    prefix.push_back(end_whole);
    split(shape, dim + 1, std::move(prefix), 0, end - end_whole * inner, out);
  }
}

} // namespace

std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  int64_t numel = 1;
  for (int64_t size : shape) {
    numel *= size;
  }
  TORCH_INTERNAL_ASSERT(0 <= begin && begin <= end && end <= numel, "range [", begin, ", ", end, ") of ", numel);
  std::vector<Box> boxes;
  if (shape.empty()) { // a 0-d tensor: its one element, or nothing
    if (begin < end) {
      boxes.push_back(Box{});
    }
    return boxes;
  }
  split(shape, 0, {}, begin, end, boxes);
  return boxes;
}

bool intersect(const Box& a, const Box& b, Box& common) {
  TORCH_INTERNAL_ASSERT(a.offsets.size() == b.offsets.size());
  common.offsets.clear();
  common.sizes.clear();
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t first = std::max(a.offsets[d], b.offsets[d]);
    const int64_t last = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (first >= last) {
      return false;
    }
    common.offsets.push_back(first);
    common.sizes.push_back(last - first);
  }
  return true;
}

} // namespace detail
} // namespace lockstep
