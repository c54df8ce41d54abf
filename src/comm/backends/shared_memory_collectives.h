#pragma once

// Internal: the Gloo and MPI groups' allreduces, broadcasts, reduce-scatters
// and all-gathers of CPU tensors between ranks that are all on one host,
// through shared memory (Note [Collectives through shared memory] in
// src/comm/backends/shared_memory_collectives.cpp).

#include <lockstep/backend.h>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// The elements of `count` that rank `rank` of `size` reduces: [first, last).
struct Slice {
  int64_t first = 0, last = 0;
};
Slice slice_of(int64_t count, int rank, int size);

class SharedMemoryCollectives {
 public:
  /// Every rank's string, in rank order, given this rank's. Called by every
  /// rank with the same `stage`, once per stage.
  using Exchange = std::function<std::vector<std::string>(const std::string& stage, const std::string& mine)>;

  /// Every rank's segment, mapped, where every rank of the group is on this
  /// host, can map them, and is `willing`; nullptr on every rank otherwise.
  /// Called by every rank of the group, which exchange through `exchange`.
  static std::unique_ptr<SharedMemoryCollectives> connect(const Exchange& exchange, bool willing, int rank, int size,
                                                          std::chrono::milliseconds timeout);
  /// The Gloo group's: over its store, willing unless LOCKSTEP_GLOO_SHM=0.
  static std::unique_ptr<SharedMemoryCollectives> connect(c10d::Store& store, int rank, int size,
                                                          std::chrono::milliseconds timeout);
  ~SharedMemoryCollectives();
  SharedMemoryCollectives(const SharedMemoryCollectives&) = delete;
  SharedMemoryCollectives& operator=(const SharedMemoryCollectives&) = delete;

  /// Whether `t` can take part: a non-empty contiguous CPU tensor of a dtype
  /// ATen adds, and Sum, Max or Min, or, for an allreduce, Avg of float or
  /// double (Note [An average divided where it is summed]).
  static bool fits(const torch::Tensor& t, ReduceOp op = ReduceOp::Sum);
  /// A group's GroupImpl::averages, where `shm` is its transport or null:
  /// float and double on the CPU, through shared memory.
  static bool averages(const SharedMemoryCollectives* shm, torch::ScalarType dtype, torch::Device device);

  // Each throws on a rank whose collective differs, a rank that exited, the
  // timeout, or after any earlier failure. Every rank's results are the same
  // bits. `words`, where defined, is a planned collective's room (Note
  // [Planned rings] in src/comm/planned_collective.cpp), whose every slot
  // holds its rank's words once the call returns.

  /// `tensor` reduced by `op` across the ranks, in place. Where it is
  /// exactly one of share()'s buffers, the ranks' copies are reduced where
  /// they lie.
  void allreduce(const torch::Tensor& tensor, ReduceOp op);
  /// Memory every rank maps: one zeroed uint8 tensor per entry of `bytes`
  /// (GroupImpl::shared_buffers), or {} on every rank, where the ranks'
  /// sizes differ, one is not positive, or there is no room. Called by every
  /// rank.
  std::vector<torch::Tensor> share(const std::vector<int64_t>& bytes);
  /// GroupImpl::reduce_scatter's: `output` (n elements) receives every rank's
  /// input[rank*n, (rank+1)*n) reduced by `op`.
  void reduce_scatter(const torch::Tensor& output, const torch::Tensor& input, ReduceOp op, const torch::Tensor& words);
  /// outputs[r] (contiguous, input's size and dtype) receives rank r's `input`.
  void all_gather(const std::vector<torch::Tensor>& outputs, const torch::Tensor& input, const torch::Tensor& words);
  /// Rank `root`'s `tensor` copied into every rank's.
  void broadcast(const torch::Tensor& tensor, int root);
  /// Ends any wait with an error: the group is going away.
  void stop();

  enum Kind : int32_t { kAllreduce, kReduceScatter, kAllGather, kBroadcast };
  /// What a rank is running, in its header: every rank's must be equal.
  struct Call {
    int32_t kind = 0, dtype = 0, op = 0; // op: a broadcast's root
    int64_t elements = 0; // the input's
    int32_t planned = 0;  // whether it carries a plan's words
    int32_t buffer = -1;  // an allreduce of share()'s buffer: its number
  };

 private:
  static constexpr int64_t kWordRoom = 24; // doubles of words per rank
  struct Header;
  struct Region; // a share()'s memory, every rank's mapping of it
  struct Buffer { // one of share()'s tensors
    std::weak_ptr<Region> region;
    int64_t offset = 0, bytes = 0;
    int32_t number = 0; // the same on every rank: share()'s are collectives
  };
  SharedMemoryCollectives(int rank, int size, std::chrono::milliseconds timeout);
  Header& header(int rank) const;
  char* data(int rank) const;
  torch::Tensor slice(int rank, int64_t offset, int64_t count, torch::ScalarType dtype) const;
  void check_usable() const;
  uint32_t meet(const Call& call, const std::function<void(char*)>& fill, const torch::Tensor& words);
  // out = terms[0] op terms[1] op ..., one term per rank in rank order.
  void reduce_into(torch::Tensor& out, const std::vector<torch::Tensor>& terms, ReduceOp op, bool out_is_an_input);
  void reduce_terms(torch::Tensor& out, const std::vector<torch::Tensor>& terms, ReduceOp op, bool out_is_an_input);
  int64_t held_by_all() const;
  const Buffer* buffer_of(const torch::Tensor& tensor, std::shared_ptr<Region>& region) const;
  void allreduce_where_it_lies(const torch::Tensor& tensor, const Buffer& buffer, const Region& region, ReduceOp op);
  std::vector<std::string> exchange_records(const std::string& mine);
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
  torch::Tensor scratch_; // an allreduce slice's partial result, beyond two ranks
  std::vector<Buffer> buffers_;
  int32_t buffers_shared_ = 0;
};

} // namespace detail
} // namespace lockstep
