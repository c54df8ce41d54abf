#pragma once

// Internal: the Gloo group's allreduces of CPU tensors between ranks that are
// all on one host, through shared memory (Note [Allreduce through shared
// memory] in src/comm/backends/shared_memory_collectives.cpp).

#include <lockstep/backend.h>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// What a rank publishes of its host: the host name, the boot and the
/// namespaces that shared memory and process ids live in. Ranks whose
/// identities are equal can map each other's segments.
std::string host_identity();

/// Whether ranks that published `published` (each "off", or
/// "<identity> <segment> <pid>") can all share memory: none is off, and every
/// identity is the first one's.
bool one_host(const std::vector<std::string>& published);

/// The elements of `count` that rank `rank` of `size` reduces: [first, last).
struct Slice {
  int64_t first = 0, last = 0;
};
Slice slice_of(int64_t count, int rank, int size);

class SharedMemoryCollectives {
 public:
  /// Every rank's segment, mapped, where every rank of the group is on this
  /// host, can map them, and has not set LOCKSTEP_GLOO_SHM=0; nullptr on
  /// every rank otherwise. Called by every rank of the group, over its store.
  static std::unique_ptr<SharedMemoryCollectives> connect(c10d::Store& store, int rank, int size,
                                                        std::chrono::milliseconds timeout);
  ~SharedMemoryCollectives();
  SharedMemoryCollectives(const SharedMemoryCollectives&) = delete;
  SharedMemoryCollectives& operator=(const SharedMemoryCollectives&) = delete;

  /// Whether run() takes this allreduce: one contiguous CPU tensor of a dtype
  /// ATen adds, and Sum, Max or Min.
  static bool fits(const std::vector<torch::Tensor>& tensors, ReduceOp op);
  /// `tensor` reduced by `op` across the ranks, in place, every rank's result
  /// the same bits. Throws on a rank whose allreduce differs, a rank that
  /// exited, the timeout, or after any earlier failure.
  void run(const torch::Tensor& tensor, ReduceOp op);
  /// Ends any wait with an error: the group is going away.
  void stop();

 private:
  struct Header;
  SharedMemoryCollectives(int rank, int size, std::chrono::milliseconds timeout);
  Header& header(int rank) const;
  char* data(int rank) const;
  void piece(char* bytes, int64_t count, const torch::Tensor& tensor, ReduceOp op);
  void reduce_slice(int64_t count, torch::ScalarType dtype, ReduceOp op);
  void advance();
  void wait_all(uint32_t phase);
  void wait_for(int peer, uint32_t phase);
  [[noreturn]] void fail(const std::string& why);

  int rank_, size_;
  int64_t capacity_; // bytes of data in each segment
  std::chrono::milliseconds timeout_;
  std::vector<void*> maps_; // every rank's segment, rank by rank
  std::vector<int64_t> pids_;
  uint32_t phase_ = 0; // this rank's, as last published
  std::string failed_;
  std::atomic<bool> stopping_{false};
  torch::Tensor scratch_; // a slice's partial sum, beyond two ranks
};

} // namespace detail
} // namespace lockstep
