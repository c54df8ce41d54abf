#pragma once

// Checks shared by the scenarios of lockstep_ddp_worker (tests/ddp_worker.cpp
// and the files beside it): a failed check prints "CHECK FAILED" and counts
// (support/run_worker.h), so that every check of a scenario runs and the
// process exits 1 at the end.

#include <lockstep/lockstep.h>

#include "ddp_models.h"
#include "run_worker.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

inline void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    report_failure(rank, what);
  }
}

// Expects `body` to throw a c10::Error on this rank whose message holds every
// one of `needles`.
template <typename F>
void expect_error(const ProcessGroup& group, F body, const std::vector<std::string>& needles) {
  try {
    body();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& needle : needles) {
      check(message.find(needle) != std::string::npos, "the error names '" + needle + "': " + message, group.rank());
    }
    return;
  }
  check(false, "an error was expected", group.rank());
}

// Rows per rank in the scenarios' batches (global_batch(kPerRank, rank)).
constexpr int64_t kPerRank = 4;

inline OddNet copy_of(const OddNet& net) {
  return OddNet(std::dynamic_pointer_cast<OddNetImpl>(net->clone()));
}

inline void check_identical_across_ranks(const ProcessGroup& group, torch::nn::Module& module, const std::string& when = "") {
  for (const auto& p : module.named_parameters()) {
    auto all = group.all_gather(p.value().detach());
    for (size_t k = 1; k < all.size(); ++k) {
      check(torch::equal(all[0], all[k]), "'" + p.key() + "' bitwise equal on rank " + std::to_string(k) + when, group.rank());
    }
  }
}

inline void check_close(torch::nn::Module& expected, torch::nn::Module& got, double rtol, double atol, int rank, const std::string& what) {
  auto e = expected.named_parameters();
  auto g = got.named_parameters();
  for (size_t i = 0; i < e.size(); ++i) {
    const bool ok = torch::allclose(e[i].value(), g[i].value(), rtol, atol);
    check(ok, what + " '" + e[i].key() + "' max diff " + (ok ? "" : std::to_string((e[i].value() - g[i].value()).abs().max().item<double>())), rank);
  }
}

struct DoneWork : Work {
  void wait() override {}
};

// Forwards a group's calls and counts the allreduces.
class CountingGroup : public GroupImpl {
 public:
  explicit CountingGroup(ProcessGroup inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return inner_.backend(); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }
  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    ++allreduces;
    return inner_.allreduce_async(tensors, op, std::move(what));
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    return inner_.broadcast_async(tensors, root, std::move(what));
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string) override {
    outputs = inner_.all_gather(input);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> barrier(std::string) override {
    inner_.barrier();
    return std::make_shared<DoneWork>();
  }
  int allreduces = 0;

 private:
  ProcessGroup inner_;
};

// Scenarios in tests/ddp_worker_syncbn_join.cpp: SyncBatchNorm against one
// BatchNorm on the whole batch, and join() with uneven inputs.
void sync_batch_norm(const ProcessGroup& group);
void sync_batch_norm_cuda(const ProcessGroup& group);
void sync_batch_norm_ddp(const ProcessGroup& group);
void join(const ProcessGroup& group, std::vector<int> counts, bool divide_by_initial_world_size);
void join_throw(const ProcessGroup& group, std::vector<int> counts);

// Scenarios in tests/ddp_worker_desync.cpp: ranks that disagree on a
// collective, for the checks, the flight records and the desync report.
void desync_avg(const ProcessGroup& group);
void desync_after_caught(const ProcessGroup& group);
void desync_detail(const ProcessGroup& group, bool other_op);
void desync_in_a_second_group(const ProcessGroup&);

// Scenarios in tests/ddp_worker_answers.cpp: what wrapping in DDP must not
// change (issue "Wrapping must never change the answer").
void shared_parameters(const ProcessGroup& group);
void unused_across_no_sync(const ProcessGroup& group, bool views);
void wrapped_twice(const ProcessGroup& group);
void options_differ(const ProcessGroup& group);
void plans_in_another_order(const ProcessGroup& group);

} // namespace testing
} // namespace lockstep
