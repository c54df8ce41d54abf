#pragma once

// Internal: a GroupImpl over any c10d object with c10d's collective methods.
// LibTorch 1.13's Gloo group is a c10d::ProcessGroup and 2.x's a
// c10d::Backend; both have the same allreduce/broadcast/allgather/barrier, so
// one template serves both: the backends (src/comm/backends/<name>.cpp) and
// lockstep::from_c10d (c10d.h) name the type.

#include <lockstep/backend.h>
#include <lockstep/detail/collective_errors.h>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/util/Exception.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

namespace lockstep {
namespace detail {

// Polls `done` for up to `spin`, yielding the core to any thread that can
// run, before a wait that sleeps (Note [Polling before a wait] in
// src/comm/backends/polling.cpp).
template <typename Done>
void poll_for(std::chrono::microseconds spin, Done&& done) {
  if (spin.count() <= 0) {
    return;
  }
  const auto until = std::chrono::steady_clock::now() + spin;
  while (!done() && std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
}

class C10dWork : public Work {
 public:
  C10dWork(
      c10::intrusive_ptr<c10d::Work> work,
      std::string what,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      Diagnose diagnose,
      std::chrono::microseconds spin = {})
      : work_(std::move(work)),
        what_(std::move(what)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        diagnose_(std::move(diagnose)),
        spin_(spin) {}
  void wait() override {
    try {
      // The backend's choice: a GPU's wait only orders streams, and must not poll.
      poll_for(spin_, [&] { return work_->isCompleted(); });
      work_->wait();
    } catch (const c10::Error& e) {
      throw_collective_error(what_, rank_, size_, timeout_, e.msg(), diagnose_);
    } catch (const std::exception& e) {
      throw_collective_error(what_, rank_, size_, timeout_, e.what(), diagnose_);
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  Diagnose diagnose_;
  std::chrono::microseconds spin_;
};

/// A collective with nothing to do.
struct DoneWork : Work {
  void wait() override {}
};

// ProcessGroup turns Avg into a sum and a division (Note [Average]), so
// backends never see it.
inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::Avg:
      break; // ProcessGroup turns it into a sum (Note [Average])
  }
  TORCH_INTERNAL_ASSERT(false, "ReduceOp::Avg reached a c10d backend");
}

template <typename Group>
class C10dGroup : public GroupImpl {
 public:
  C10dGroup(
      c10::intrusive_ptr<Group> group,
      std::string backend,
      std::chrono::milliseconds timeout,
      Diagnose diagnose = {})
      : group_(std::move(group)), backend_(std::move(backend)), timeout_(timeout), diagnose_(std::move(diagnose)) {}

  int rank() const override {
    return group_->getRank();
  }
  int size() const override {
    return group_->getSize();
  }
  std::string backend() const override {
    return backend_;
  }
  std::chrono::milliseconds timeout() const override {
    return timeout_;
  }
  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    if (empty(tensors)) {
      return std::make_shared<DoneWork>();
    }
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    return wrap([&] { return group_->allreduce(tensors, options); }, std::move(what));
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    if (empty(tensors)) {
      return std::make_shared<DoneWork>();
    }
    c10d::BroadcastOptions options;
    options.rootRank = root;
    return wrap([&] { return group_->broadcast(tensors, options); }, std::move(what));
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) override {
    if (input.numel() == 0) {
      return std::make_shared<DoneWork>();
    }
    std::vector<std::vector<torch::Tensor>> out{outputs};
    std::vector<torch::Tensor> in{input};
    auto work = wrap([&] { return group_->allgather(out, in); }, std::move(what));
    // c10d fills the tensors of `out`, which share storage with `outputs`.
    return work;
  }
  std::shared_ptr<Work> barrier(std::string what) override {
    return wrap([&] { return group_->barrier(); }, std::move(what));
  }

 protected:
  Group& c10d_group() const {
    return *group_;
  }
  const Diagnose& diagnose() const {
    return diagnose_;
  }
  // How long each wait polls before it sleeps (C10dWork); none by default.
  void spin_before_waits(std::chrono::microseconds spin) {
    spin_ = spin;
  }
  std::chrono::microseconds spin_before_waits() const {
    return spin_;
  }
  // Gloo divides by the element count: an empty tensor would crash it (SIGFPE
  // in gloo::allgather). Shapes agree on every rank, so all ranks skip alike.
  static bool empty(const std::vector<torch::Tensor>& tensors) {
    for (const auto& t : tensors) {
      if (t.numel() > 0) {
        return false;
      }
    }
    return true;
  }

  // What c10d throws while starting a collective is its refusal of this
  // rank's arguments: nothing was sent, and no other rank is at fault.
  template <typename F>
  std::shared_ptr<Work> wrap(F&& start, std::string what) {
    try {
      return std::make_shared<C10dWork>(start(), std::move(what), rank(), size(), timeout_, diagnose_, spin_);
    } catch (const c10::Error& e) {
      throw_refusal(what, rank(), size(), backend_, e.msg());
    } catch (const std::exception& e) {
      throw_refusal(what, rank(), size(), backend_, e.what());
    }
  }

 private:
  c10::intrusive_ptr<Group> group_;
  std::string backend_;
  std::chrono::milliseconds timeout_;
  Diagnose diagnose_;
  std::chrono::microseconds spin_{0};
};

} // namespace detail

} // namespace lockstep
