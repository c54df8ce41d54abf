// Buffers that every rank of a group through shared memory maps, and the
// allreduce that reduces them where they lie.
#include "comm/backends/shared_memory_collectives.h"
#include "comm/backends/shared_memory_segments.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <sys/mman.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace lockstep {
namespace detail {

// Note [Buffers every rank can reach]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An allreduce through the segments (Note [Collectives through shared
// memory]) passes over its bytes three times beside the reduction: into the
// rank's segment, and every rank's reduced slice back out. On two ranks of
// one core each, DDP's 7.5 MB of gradients a step on the MLP, those passes
// were a tenth of the step (docs/performance.md, "DDP over MPI against no
// communication"), on cores whose memory the other rank's compute shares.
// So DistributedDataParallel asks its group for bucket memory that every
// rank maps (GroupImpl::shared_buffers), and an allreduce of exactly one such
// buffer reads every rank's copy where it lies: each rank reduces its slice
// of every rank's buffer, in rank order, into its own, and copies the result
// into the others' in the same pass, a chunk at a time while the chunk is in
// cache. Every slice is reduced once, as through the segments, so the bits
// are the same as there.
//
// share() is a collective. Each rank makes one segment for all the buffers
// asked for, and the ranks exchange its name, with a hash of the sizes,
// through an all-gather of the segments; every rank maps every other's, and
// a second all-gather says whether all did. Any rank that could not (sizes
// that differ or are not positive, no room: the ranks' copies together may
// take at most half of what /dev/shm has free, counting the group's earlier
// buffers, which a rebuild of the buckets gives back) makes every rank's
// answer empty, and the caller allocates as usual. A buffer's number, the same on every rank, goes in the
// allreduce's header, so a rank whose allreduce is of another buffer, or of
// memory of its own, fails every rank at once, naming both. The segments are
// unlinked once mapped; a buffer's tensor keeps every rank's mapping alive,
// so memory stays valid while any tensor views it, even past the group. A
// rank whose collective fails (a peer past the timeout) may still have its
// buffer written by a slower peer finishing its slice: the error stands, and
// the buffer's contents are not used.

namespace {

constexpr int64_t kAlign = 64;               // each buffer starts on a cache line
constexpr int64_t kChunkBytes = 256 << 10;   // reduced, then copied out, while in cache
constexpr int64_t kRecordBytes = 128;        // a rank's line in share()'s exchanges

// Whether /dev/shm has room for `bytes` more: at most half of what is free
// and of what `held` bytes of earlier buffers take, which a rebuild of the
// same buckets gives back once it is done.
bool room_for(int64_t bytes, int64_t held) {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) {
    return false;
  }
  const auto free_bytes = static_cast<long double>(fs.f_bavail) * static_cast<long double>(fs.f_frsize);
  return static_cast<long double>(bytes) <= (free_bytes + static_cast<long double>(held)) / 2;
}

} // namespace

struct SharedMemoryCollectives::Region {
  Region(int size, int64_t bytes) : maps(size, nullptr), bytes(bytes) {}
  ~Region() {
    for (void* at : maps) {
      if (at != nullptr) {
        ::munmap(at, bytes);
      }
    }
  }
  std::vector<void*> maps; // every rank's, rank by rank
  int64_t bytes;
};

std::vector<std::string> SharedMemoryCollectives::exchange_records(const std::string& mine) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(mine.size()) < kRecordBytes, "a record outgrew its room");
  auto input = torch::zeros({kRecordBytes}, torch::kUInt8);
  std::memcpy(input.data_ptr(), mine.data(), mine.size());
  std::vector<torch::Tensor> outputs;
  for (int q = 0; q < size_; ++q) {
    outputs.push_back(torch::empty({kRecordBytes}, torch::kUInt8));
  }
  all_gather(outputs, input, {});
  std::vector<std::string> records;
  for (const auto& out : outputs) {
    const char* text = static_cast<const char*>(out.data_ptr());
    records.emplace_back(text, ::strnlen(text, kRecordBytes));
  }
  return records;
}

std::vector<torch::Tensor> SharedMemoryCollectives::share(const std::vector<int64_t>& bytes) {
  check_usable();
  buffers_.erase(std::remove_if(buffers_.begin(), buffers_.end(), [](const Buffer& b) { return b.region.expired(); }),
                 buffers_.end());
  std::vector<int64_t> offsets;
  int64_t total = 0;
  uint64_t hash = 1469598103934665603ull; // FNV-1a over the sizes
  bool wanted = !bytes.empty();
  for (const int64_t b : bytes) {
    wanted = wanted && b > 0;
    offsets.push_back(total);
    total += (b + kAlign - 1) / kAlign * kAlign;
    hash = (hash ^ static_cast<uint64_t>(b)) * 1099511628211ull;
  }
  auto region = std::make_shared<Region>(size_, total);
  const std::string name = new_segment_name();
  JoiningSegments joining; // Note [Segments of a group that is joining]
  if (wanted && room_for(total * size_, held_by_all())) {
    region->maps[rank_] = map_segment(name, total, /*create=*/true);
  }
  if (region->maps[rank_] != nullptr) {
    joining.add(name);
  }
  std::ostringstream terms;
  terms << bytes.size() << ':' << total << ':' << std::hex << hash;
  const auto published = exchange_records(region->maps[rank_] != nullptr ? terms.str() + " " + name : "off");
  bool mapped = true;
  for (int q = 0; q < size_; ++q) {
    std::istringstream in(published[q]);
    std::string theirs, segment;
    in >> theirs >> segment;
    if (q != rank_ && segment.rfind("/lockstep-", 0) == 0) {
      joining.add(segment);
    }
    mapped = mapped && theirs == terms.str();
    if (mapped && q != rank_) {
      region->maps[q] = map_segment(segment, total, /*create=*/false);
      mapped = region->maps[q] != nullptr;
    }
  }
  const auto answers = exchange_records(mapped ? "1" : "0");
  if (!std::all_of(answers.begin(), answers.end(), [](const std::string& a) { return a == "1"; })) {
    return {};
  }
  std::vector<torch::Tensor> tensors;
  for (size_t i = 0; i < bytes.size(); ++i) {
    char* at = static_cast<char*>(region->maps[rank_]) + offsets[i];
    const auto keep = [region](void*) {}; // every rank's mapping lives while a tensor views it
    tensors.push_back(torch::from_blob(at, {bytes[i]}, keep, torch::TensorOptions().dtype(torch::kUInt8)));
    buffers_.push_back({region, offsets[i], bytes[i], buffers_shared_++});
  }
  return tensors;
}

// The bytes of this group's live buffers, every rank's copies together.
int64_t SharedMemoryCollectives::held_by_all() const {
  std::vector<const Region*> seen;
  int64_t held = 0;
  for (const auto& b : buffers_) {
    auto r = b.region.lock();
    if (r && std::find(seen.begin(), seen.end(), r.get()) == seen.end()) {
      seen.push_back(r.get());
      held += r->bytes * size_;
    }
  }
  return held;
}

const SharedMemoryCollectives::Buffer* SharedMemoryCollectives::buffer_of(const torch::Tensor& tensor,
                                                                          std::shared_ptr<Region>& region) const {
  const char* at = static_cast<const char*>(tensor.data_ptr());
  const int64_t bytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  for (const auto& b : buffers_) {
    auto r = b.region.lock();
    if (r && at == static_cast<const char*>(r->maps[rank_]) + b.offset && bytes == b.bytes) {
      region = std::move(r);
      return &b;
    }
  }
  return nullptr;
}

void SharedMemoryCollectives::allreduce_where_it_lies(const torch::Tensor& tensor, const Buffer& buffer,
                                                      const Region& region, ReduceOp op) {
  const int64_t item = tensor.element_size();
  Call call{kAllreduce, static_cast<int32_t>(tensor.scalar_type()), static_cast<int32_t>(op), tensor.numel()};
  call.buffer = buffer.number;
  const uint32_t start = meet(call, [](char*) {}, {});
  const auto at = [&](int q, int64_t element) {
    return static_cast<char*>(region.maps[q]) + buffer.offset + element * item;
  };
  const auto options = torch::TensorOptions().dtype(tensor.scalar_type());
  const Slice mine = slice_of(tensor.numel(), rank_, size_);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / item);
  for (int64_t first = mine.first; first < mine.last; first += chunk) {
    const int64_t count = std::min(chunk, mine.last - first);
    std::vector<torch::Tensor> terms;
    for (int q = 0; q < size_; ++q) {
      terms.push_back(torch::from_blob(at(q, first), {count}, options));
    }
    auto out = terms[rank_];
    reduce_into(out, terms, op, /*out_is_an_input=*/true);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) {
        std::memcpy(at(q, first), at(rank_, first), static_cast<size_t>(count * item));
      }
    }
  }
  advance();
  wait_all(start + 2);
}

} // namespace detail
} // namespace lockstep
