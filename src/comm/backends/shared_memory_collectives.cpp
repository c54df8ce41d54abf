// Compiled with gloo.cpp, when LibTorch has c10d's Gloo process group.

#include "comm/backends/shared_memory_collectives.h"
#include "comm/backends/same_host.h"
#include "comm/backends/shared_memory_segments.h"

#include <lockstep/timeline.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

namespace lockstep {
namespace detail {

// Note [Collectives through shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Between ranks on one host, Gloo's TCP moves every byte through the
// kernel twice, on loopback, and wakes each rank's threads through epoll;
// on the few cores that the ranks' own compute already fills, that CPU time
// comes out of the step (docs/performance.md, "Gloo DDP against PyTorch's
// DDP"). Open MPI exchanges through shared memory instead, and DDP over it is
// a quarter faster. So where every rank of a Gloo group is on this host (the
// same host name, boot, and network, IPC, mount and process namespaces: two
// network namespaces are two hosts to the job), its allreduces, broadcasts,
// reduce-scatters and all-gathers of CPU tensors, the agreement check's
// included, go through shared memory; barriers and the rest stay Gloo's.
// Every collective names in its header what it runs, and whether it
// carries a plan's words, so a planned collective that meets a check, or
// another kind of collective, fails at once on every rank instead of pairing
// (Note [Planned collectives]).
//
// Each rank owns one segment: a header and capacity_of(size) bytes, 8 MiB
// for two ranks, less for more, so that a host's ranks map at most 16 MiB
// together beyond 2 (Docker gives /dev/shm 64 MiB). A collective runs in
// pieces that fit it, each in phases published by advancing the rank's
// phase counter, a futex word:
//   1. (meet) once every rank is past the last phase of its previous piece,
//      having read what this rank left there, the rank copies its piece
//      into its segment and writes in its header what it runs (kind, element
//      count, dtype, op, whether planned) and, on a planned collective's
//      first piece, its words; once every rank is past 1, it checks every
//      header against its own (a difference is an error on every rank, each
//      seeing the same headers) and copies the other ranks' words;
//   2. an allreduce reduces its slice (slice_of) of every rank's piece, in
//      rank order, into its own segment's slice (its own term read from the
//      tensor, which phase 1 copied all of but that slice), and once every rank is past
//      2, copies every rank's reduced slice out; a reduce-scatter, whose
//      piece holds a part of every other rank's chunk, reduces its own
//      chunk's part of every other segment, and of its own input, into its
//      output; an all-gather copies every segment out, a broadcast the root's.
// Each slice is reduced once, by one rank, so every rank gets the same bits.
// A wait spins briefly, then sleeps on the peer's futex in slices of
// kWaitSlice, between which it fails if the peer's process has exited, the
// group is going away, or the group's timeout has passed. After a failure the
// phases no longer agree, so every later collective fails at once.
//
// Segments are unlinked once every rank has mapped them, or the group's
// making failed: nothing is left in /dev/shm once the group is made, however
// the job ends. LOCKSTEP_GLOO_SHM=0 keeps every collective on Gloo's TCP.
//
// The MPI group does the same where every rank is on one host: DDP's step
// over it ran 1.00 to 1.07 x the one through Open MPI's own collectives, and
// FullyShardedDataParallel's ShardGradOp 1.13 to 1.29 x (docs/performance.md,
// 2 ranks on 2 cores), and a rank that exits or runs another collective is
// found here as over Gloo. Its ranks exchange their segments' names through
// MPI itself, which needs no store. LOCKSTEP_MPI_SHM=0 keeps Open MPI's.
//
// Note [An average divided where it is summed]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An average is a sum divided by the group's size (Note [Average] in
// src/comm/process_group.cpp). Divided by ProcessGroup once the allreduce is
// done, it costs every rank a pass over its whole tensor. Here, instead, each
// rank divides the slice it has just reduced, before the others copy it: in a
// shared buffer, chunk by chunk while the chunk is in cache; staged, the
// piece's slice. That is one pass over 1/size of the tensor. The bits are
// ProcessGroup's: the sum in rank order, then Tensor::div_ (or, for a power
// of two, a multiplication by its reciprocal, which is the same real number
// rounded the same way, without a division's cost). One caveat: the division
// runs on the backend's thread, not the one that waits, so a caller that
// flushes denormals on its own thread (at::globalContext().setFlushDenormal)
// gets the backend thread's rounding of subnormal averages. Only allreduces
// of float and double average here (GroupImpl::averages): 16-bit types keep
// ProcessGroup's way (float16 divides first), and a planned collective's
// words go in times the group's size, which the division gives back exactly
// only in these two types (write_plan_words). DistributedDataParallel's
// buckets use it (Reducer::State::backend_averages).

namespace {

constexpr int64_t kHeaderBytes = 256;
constexpr int kSpins = 256;
constexpr auto kWaitSlice = std::chrono::milliseconds(50);

bool reached(uint32_t phase, uint32_t target) {
  return static_cast<int32_t>(phase - target) >= 0; // the counters wrap
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::milliseconds slice) {
  timespec ts{};
  ts.tv_sec = slice.count() / 1000;
  ts.tv_nsec = (slice.count() % 1000) * 1000000;
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// The span of one collective on the thread that runs it, around its
// "waiting for the other ranks" (Note [Timeline] in src/util/timeline.cpp).
timeline::Span collective_span(const char* kind, const torch::Tensor& tensor) {
  return timeline::Span([kind] { return std::string(kind) + " through shared memory"; },
                        tensor.numel() * static_cast<int64_t>(tensor.element_size()));
}

int64_t capacity_of(int size) {
  return std::min<int64_t>(8 << 20, std::max<int64_t>(1 << 20, (16 << 20) / size));
}

std::string key_of(const char* what, int rank) {
  return std::string("lockstep/shm_") + what + "/" + std::to_string(rank);
}

void publish(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string read(c10d::Store& store, const std::string& key) {
  const auto bytes = store.get(key);
  return std::string(bytes.begin(), bytes.end());
}

const char* op_name(int32_t op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Avg:
      return "avg";
    default:
      return "sum";
  }
}

std::string describe(const SharedMemoryCollectives::Call& call) {
  const char* kinds[] = {"an allreduce", "a reduce-scatter", "an all-gather", "a broadcast"};
  const bool known = call.kind >= 0 && call.kind < 4 && call.dtype >= 0 &&
      call.dtype < static_cast<int32_t>(c10::ScalarType::NumOptions);
  if (!known) {
    return "unknown";
  }
  std::string text = std::string(kinds[call.kind]) + (call.planned ? " of a plan" : "") + " of " +
      std::to_string(call.elements) + " elements of " + c10::toString(static_cast<c10::ScalarType>(call.dtype)) +
      (call.buffer >= 0 ? " in shared buffer " + std::to_string(call.buffer) : "");
  switch (call.kind) {
    case SharedMemoryCollectives::kAllGather:
      return text;
    case SharedMemoryCollectives::kBroadcast:
      return text + " (root " + std::to_string(call.op) + ")";
    default:
      return text + " (" + op_name(call.op) + ")";
  }
}

} // namespace

struct SharedMemoryCollectives::Header {
  std::atomic<uint32_t> phase;
  std::atomic<uint32_t> waiters;
  Call call;
  double words[kWordRoom]; // a planned collective's (Note [Planned rings])
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain words");

Slice slice_of(int64_t count, int rank, int size) {
  const int64_t each = (count + size - 1) / size;
  const int64_t first = std::min(count, each * rank);
  return {first, std::min(count, first + each)};
}

SharedMemoryCollectives::SharedMemoryCollectives(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), capacity_(capacity_of(size)), timeout_(timeout), maps_(size, nullptr), pids_(size, 0) {}

std::unique_ptr<SharedMemoryCollectives> SharedMemoryCollectives::connect(c10d::Store& store, int rank, int size,
                                                                      std::chrono::milliseconds timeout) {
  const char* env = std::getenv("LOCKSTEP_GLOO_SHM");
  const bool willing = !(env != nullptr && std::string(env) == "0");
  const Exchange exchange = [&store, rank, size](const std::string& stage, const std::string& mine) {
    publish(store, key_of(stage.c_str(), rank), mine);
    std::vector<std::string> all(size);
    for (int r = 0; r < size; ++r) {
      all[r] = read(store, key_of(stage.c_str(), r));
    }
    return all;
  };
  return connect(exchange, willing, rank, size, timeout);
}

std::unique_ptr<SharedMemoryCollectives> SharedMemoryCollectives::connect(const Exchange& exchange, bool willing,
                                                                      int rank, int size,
                                                                      std::chrono::milliseconds timeout) {
  const bool wanted = size > 1 && willing;
  std::unique_ptr<SharedMemoryCollectives> shm(new SharedMemoryCollectives(rank, size, timeout));
  const std::string name = new_segment_name();
  JoiningSegments joining; // Note [Segments of a group that is joining] in shared_memory_segments.cpp
  shm->maps_[rank] = wanted ? map_segment(name, kHeaderBytes + shm->capacity_, /*create=*/true) : nullptr;
  if (shm->maps_[rank] != nullptr) {
    joining.add(name);
  }
  const auto published = exchange(
      "segment", shm->maps_[rank] != nullptr ? host_identity() + " " + name + " " + std::to_string(::getpid()) : "off");
  for (int r = 0; r < size; ++r) {
    std::istringstream in(published[r]);
    std::string identity, segment;
    if (r != rank && in >> identity >> segment && segment.rfind("/lockstep-", 0) == 0) {
      joining.add(segment);
    }
  }
  bool mapped = one_host(published);
  for (int r = 0; mapped && r < size; ++r) {
    std::istringstream in(published[r]);
    std::string identity, segment;
    in >> identity >> segment >> shm->pids_[r];
    if (r != rank) {
      shm->maps_[r] = map_segment(segment, kHeaderBytes + shm->capacity_, /*create=*/false);
      mapped = shm->maps_[r] != nullptr;
    }
  }
  // Whether every rank mapped every segment: then each can unlink its own.
  const auto answers = exchange("mapped", mapped ? "1" : "0");
  const bool all_mapped = std::all_of(answers.begin(), answers.end(), [](const std::string& a) { return a == "1"; });
  return all_mapped ? std::move(shm) : nullptr;
}

SharedMemoryCollectives::~SharedMemoryCollectives() {
  for (void* at : maps_) {
    if (at != nullptr) {
      ::munmap(at, kHeaderBytes + capacity_);
    }
  }
}

bool SharedMemoryCollectives::averages(const SharedMemoryCollectives* shm, torch::ScalarType dtype,
                                       torch::Device device) {
  return shm != nullptr && device.is_cpu() && (dtype == torch::kFloat || dtype == torch::kDouble);
}

bool SharedMemoryCollectives::fits(const torch::Tensor& t, ReduceOp op) {
  if (op == ReduceOp::Avg && t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kDouble) {
    return false; // Note [An average divided where it is summed]
  }
  switch (t.scalar_type()) {
    case torch::kFloat:
    case torch::kDouble:
    case torch::kHalf:
    case torch::kBFloat16:
    case torch::kChar:
    case torch::kByte:
    case torch::kInt:
    case torch::kLong:
      return t.device().is_cpu() && t.is_contiguous() && t.numel() > 0;
    default:
      return false;
  }
}

SharedMemoryCollectives::Header& SharedMemoryCollectives::header(int rank) const {
  static_assert(sizeof(Header) <= kHeaderBytes, "the header outgrew its room");
  return *static_cast<Header*>(maps_[rank]);
}

char* SharedMemoryCollectives::data(int rank) const {
  return static_cast<char*>(maps_[rank]) + kHeaderBytes;
}

void SharedMemoryCollectives::stop() {
  stopping_ = true;
}

void SharedMemoryCollectives::fail(const std::string& why) {
  failed_ = why;
  TORCH_CHECK(false, why);
}

void SharedMemoryCollectives::check_usable() const {
  TORCH_CHECK(failed_.empty(), "an earlier collective of this group through shared memory failed (", failed_,
              "), so the ranks no longer agree on where they are: make a new group");
}

// Phase 1 of a piece: once every rank has read this rank's last piece, fills
// the segment and the header (and, on a planned collective's first piece, its
// words), and waits for every rank's; then checks that every rank runs the
// same collective, and reads their words.
uint32_t SharedMemoryCollectives::meet(const Call& call, const std::function<void(char*)>& fill,
                                       const torch::Tensor& words) {
  const uint32_t start = phase_;
  wait_all(start);
  Header& mine = header(rank_);
  mine.call = call;
  mine.call.planned = words.defined() ? 1 : 0;
  const int64_t per_rank = words.defined() ? words.numel() / size_ : 0;
  TORCH_INTERNAL_ASSERT(per_rank <= kWordRoom, "a planned collective's words outgrew the header");
  if (per_rank > 0) {
    std::memcpy(mine.words, words.data_ptr<double>() + rank_ * per_rank, per_rank * sizeof(double));
  }
  fill(data(rank_));
  advance();
  wait_all(start + 1);
  for (int q = 0; q < size_; ++q) {
    const Call& theirs = header(q).call;
    if (theirs.kind != mine.call.kind || theirs.elements != mine.call.elements || theirs.dtype != mine.call.dtype ||
        theirs.op != mine.call.op || theirs.planned != mine.call.planned || theirs.buffer != mine.call.buffer) {
      fail("rank " + std::to_string(q) + "'s collective is " + describe(theirs) + " where rank " +
           std::to_string(rank_) + "'s is " + describe(mine.call) + ": the ranks called different collectives here");
    }
    if (per_rank > 0 && q != rank_) {
      std::memcpy(words.data_ptr<double>() + q * per_rank, header(q).words, per_rank * sizeof(double));
    }
  }
  return start;
}

void SharedMemoryCollectives::allreduce(const torch::Tensor& tensor, ReduceOp op) {
  check_usable();
  const auto span = collective_span("allreduce", tensor);
  std::shared_ptr<Region> region;
  if (const Buffer* buffer = buffer_of(tensor, region)) {
    allreduce_where_it_lies(tensor, *buffer, *region, op);
    return;
  }
  const int64_t item = tensor.element_size();
  const Call call{kAllreduce, static_cast<int32_t>(tensor.scalar_type()), static_cast<int32_t>(op), tensor.numel()};
  char* bytes = static_cast<char*>(tensor.data_ptr());
  for (int64_t first = 0; first < tensor.numel(); first += capacity_ / item) {
    const int64_t count = std::min(capacity_ / item, tensor.numel() - first);
    char* piece = bytes + first * item;
    // The others read this rank's piece but for its own slice, which it
    // reads from the tensor itself.
    const Slice mine = slice_of(count, rank_, size_);
    const uint32_t start = meet(call, [&](char* into) {
      std::memcpy(into, piece, mine.first * item);
      std::memcpy(into + mine.last * item, piece + mine.last * item, (count - mine.last) * item);
    }, {});
    // This rank's slice of every rank's piece, reduced into its own segment.
    if (mine.last > mine.first) {
      auto out = slice(rank_, mine.first * item, mine.last - mine.first, tensor.scalar_type());
      std::vector<torch::Tensor> terms;
      for (int q = 0; q < size_; ++q) {
        terms.push_back(q == rank_ ? torch::from_blob(piece + mine.first * item, {out.numel()}, out.options())
                                   : slice(q, mine.first * item, out.numel(), tensor.scalar_type()));
      }
      reduce_into(out, terms, op, /*out_is_an_input=*/false);
    }
    advance();
    wait_all(start + 2);
    for (int q = 0; q < size_; ++q) {
      const Slice s = slice_of(count, q, size_);
      std::memcpy(piece + s.first * item, data(q) + s.first * item, static_cast<size_t>((s.last - s.first) * item));
    }
    advance();
  }
}

void SharedMemoryCollectives::reduce_scatter(const torch::Tensor& output, const torch::Tensor& input, ReduceOp op,
                                             const torch::Tensor& words) {
  check_usable();
  const auto span = collective_span("reduce_scatter", input);
  TORCH_INTERNAL_ASSERT(op != ReduceOp::Avg, "ProcessGroup sums a reduce-scatter's average, then divides");
  const int64_t item = input.element_size();
  const int64_t n = output.numel();
  const Call call{kReduceScatter, static_cast<int32_t>(input.scalar_type()), static_cast<int32_t>(op), input.numel()};
  const int64_t per_piece = std::max<int64_t>(1, capacity_ / (item * size_)); // of each rank's chunk
  const char* in = static_cast<const char*>(input.data_ptr());
  auto out = output.view({-1});
  // Only the other ranks read this rank's own chunk from its segment: it adds
  // its own where it lies, unless the output shares the input's memory, where
  // the sum could overwrite terms it has yet to read.
  const bool own_in_place = !output.is_alias_of(input);
  for (int64_t first = 0; first < n; first += per_piece) {
    const int64_t count = std::min(per_piece, n - first);
    // The segment holds every chunk's part of this piece, chunk after chunk.
    meet(call, [&](char* into) {
      for (int q = 0; q < size_; ++q) {
        if (q != rank_ || !own_in_place) {
          std::memcpy(into + q * count * item, in + (q * n + first) * item, count * item);
        }
      }
    }, first == 0 ? words : torch::Tensor());
    std::vector<torch::Tensor> terms;
    for (int q = 0; q < size_; ++q) {
      terms.push_back(q == rank_ && own_in_place ? input.view({-1}).narrow(0, q * n + first, count)
                                                 : slice(q, rank_ * count * item, count, input.scalar_type()));
    }
    auto part = out.narrow(0, first, count);
    reduce_into(part, terms, op, /*out_is_an_input=*/false);
    advance();
  }
}

void SharedMemoryCollectives::all_gather(const std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
                                         const torch::Tensor& words) {
  check_usable();
  const auto span = collective_span("all_gather", input);
  const int64_t item = input.element_size();
  const Call call{kAllGather, static_cast<int32_t>(input.scalar_type()), 0, input.numel()};
  const char* in = static_cast<const char*>(input.data_ptr());
  for (int64_t first = 0; first < input.numel(); first += capacity_ / item) {
    const int64_t count = std::min(capacity_ / item, input.numel() - first);
    meet(call, [&](char* into) { std::memcpy(into, in + first * item, count * item); },
         first == 0 ? words : torch::Tensor());
    for (int q = 0; q < size_; ++q) {
      char* to = static_cast<char*>(outputs[q].data_ptr()) + first * item;
      if (q != rank_ || to != in + first * item) { // an all_gather_into's input is often its own output already
        std::memcpy(to, data(q), count * item);
      }
    }
    advance();
  }
}

void SharedMemoryCollectives::broadcast(const torch::Tensor& tensor, int root) {
  check_usable();
  const auto span = collective_span("broadcast", tensor);
  const int64_t item = tensor.element_size();
  const Call call{kBroadcast, static_cast<int32_t>(tensor.scalar_type()), root, tensor.numel()};
  char* bytes = static_cast<char*>(tensor.data_ptr());
  for (int64_t first = 0; first < tensor.numel(); first += capacity_ / item) {
    const int64_t count = std::min(capacity_ / item, tensor.numel() - first);
    meet(call, [&](char* into) {
      if (rank_ == root) {
        std::memcpy(into, bytes + first * item, count * item);
      }
    }, {});
    if (rank_ != root) {
      std::memcpy(bytes + first * item, data(root), count * item);
    }
    advance();
  }
}

torch::Tensor SharedMemoryCollectives::slice(int rank, int64_t offset, int64_t count, torch::ScalarType dtype) const {
  return torch::from_blob(data(rank) + offset, {count}, torch::TensorOptions().dtype(dtype));
}

// `out` = `terms` (one per rank) reduced in rank order, by reduce_terms;
// for Avg, then divided by the group's size.
void SharedMemoryCollectives::reduce_into(torch::Tensor& out, const std::vector<torch::Tensor>& terms, ReduceOp op,
                                          bool out_is_an_input) {
  reduce_terms(out, terms, op, out_is_an_input);
  if (op == ReduceOp::Avg && (size_ & (size_ - 1)) == 0) {
    out.mul_(1.0 / size_); // Note [An average divided where it is summed]
  } else if (op == ReduceOp::Avg) {
    out.div_(size_); // Note [An average divided where it is summed]
  }
}

// Where `out` is one of the terms, through scratch_ beyond two ranks, so
// that no term is overwritten before it is read.
void SharedMemoryCollectives::reduce_terms(torch::Tensor& out, const std::vector<torch::Tensor>& terms, ReduceOp op,
                                           bool out_is_an_input) {
  const int64_t count = out.numel();
  const auto dtype = out.scalar_type();
  auto combine = [op](torch::Tensor& into, const torch::Tensor& a, const torch::Tensor& b) {
    if (op == ReduceOp::Max) {
      torch::maximum_out(into, a, b);
    } else if (op == ReduceOp::Min) {
      torch::minimum_out(into, a, b);
    } else {
      torch::add_out(into, a, b);
    }
  };
  if (size_ == 2 || !out_is_an_input) {
    combine(out, terms[0], terms[1]);
    for (int q = 2; q < size_; ++q) {
      combine(out, out, terms[q]);
    }
    return;
  }
  if (!scratch_.defined() || scratch_.scalar_type() != dtype || scratch_.numel() < count) {
    scratch_ = torch::empty({capacity_ / static_cast<int64_t>(c10::elementSize(dtype))}, torch::TensorOptions().dtype(dtype));
  }
  auto sum = scratch_.narrow(0, 0, count);
  combine(sum, terms[0], terms[1]);
  for (int q = 2; q < size_; ++q) {
    combine(sum, sum, terms[q]);
  }
  out.copy_(sum);
}

void SharedMemoryCollectives::advance() {
  Header& mine = header(rank_);
  mine.phase.store(++phase_);
  if (mine.waiters.load() > 0) {
    futex_wake(mine.phase);
  }
}

void SharedMemoryCollectives::wait_all(uint32_t phase) {
  const timeline::Span span("waiting for the other ranks"); // Note [Timeline] in src/util/timeline.cpp
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) {
      wait_for(q, phase);
    }
  }
}

void SharedMemoryCollectives::wait_for(int peer, uint32_t phase) {
  Header& theirs = header(peer);
  for (int spin = 0; spin < kSpins; ++spin) {
    if (reached(theirs.phase.load(std::memory_order_acquire), phase)) {
      return;
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    theirs.waiters.fetch_add(1);
    const uint32_t seen = theirs.phase.load();
    if (!reached(seen, phase)) {
      futex_wait(theirs.phase, seen, kWaitSlice);
    }
    theirs.waiters.fetch_sub(1);
    if (reached(theirs.phase.load(), phase)) {
      return;
    }
    if (stopping_) {
      fail("the group was destroyed while this collective waited for rank " + std::to_string(peer));
    }
    if (process_exited(static_cast<int>(pids_[peer]))) {
      fail("rank " + std::to_string(peer) + " (process " + std::to_string(pids_[peer]) +
           " on this host) exited before it reached this collective");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      fail("rank " + std::to_string(peer) + " did not reach this collective within " + std::to_string(timeout_.count()) +
           " ms (shared memory)");
    }
  }
}

} // namespace detail
} // namespace lockstep
