#pragma once

// Internal: a Work that wraps another and passes on what describes it
// (whether it started), as ForwardingGroup does for groups. The wrappers
// override wait() to do their part after the inner Work's.

#include <lockstep/backend.h>

#include <memory>
#include <utility>

namespace lockstep {
namespace detail {

class ForwardingWork : public Work {
 public:
  explicit ForwardingWork(std::shared_ptr<Work> inner) : inner_(std::move(inner)) {}

  void wait() override {
    inner_->wait();
  }
  bool started() const override {
    return inner_->started();
  }

 protected:
  std::shared_ptr<Work> inner_;
};

} // namespace detail
} // namespace lockstep
