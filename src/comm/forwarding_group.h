#pragma once

// Internal: a GroupImpl that wraps another and passes on what describes it
// (rank, size, backend, timeout, what it supports and averages). The wrappers, the
// agreement check (src/comm/collective_check.cpp) and the flight recorder
// (src/comm/flight_recorder.cpp), override the collectives.

#include <lockstep/backend.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>

namespace lockstep {
namespace detail {

class ForwardingGroup : public GroupImpl {
 public:
  explicit ForwardingGroup(std::shared_ptr<GroupImpl> inner) : inner_(std::move(inner)) {}

  int rank() const override {
    return inner_->rank();
  }
  int size() const override {
    return inner_->size();
  }
  std::string backend() const override {
    return inner_->backend();
  }
  std::chrono::milliseconds timeout() const override {
    return inner_->timeout();
  }
  bool supports(Collective op, torch::ScalarType dtype, torch::Device device) const override {
    return inner_->supports(op, dtype, device);
  }
  bool averages(torch::ScalarType dtype, torch::Device device) const override {
    return inner_->averages(dtype, device);
  }
  bool cheap_collective_starts() const override {
    return inner_->cheap_collective_starts();
  }
  bool pairs_collectives_by_kind(torch::Device device) const override {
    return inner_->pairs_collectives_by_kind(device);
  }
  std::vector<torch::Tensor> shared_buffers(const std::vector<int64_t>& bytes) override {
    return inner_->shared_buffers(bytes);
  }

 protected:
  std::shared_ptr<GroupImpl> inner_;
};

} // namespace detail
} // namespace lockstep
