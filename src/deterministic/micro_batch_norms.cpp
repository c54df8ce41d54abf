#include "deterministic/micro_batch_norms.h"

#include <lockstep/sync_batch_norm.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <unordered_set>

namespace lockstep {
namespace detail {

// Note [Running statistics over micro-batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In training, BatchNorm normalises with the micro-batch's own statistics s
// and updates its running ones: r <- momentum * s + (1 - momentum) * r. On
// one device running V micro-batches in order, r after a step depends on
// all of them, in order; on W ranks, each rank's r would see only its own.
// So before each micro-batch the running statistics are zeroed, and forward
// leaves x = momentum * s in them (LibTorch's own product, the same on any
// rank). The x's of every micro-batch go in the step's all_gather (Note [The
// same bits at any world size]), and every rank then replays, from the
// statistics the step started with, r <- r * (1 - momentum) + x for v = 0 ..
// V-1, and adds to num_batches_tracked one per update. The replay is the same
// arithmetic in the same order on every rank and at every W. A layer in eval
// mode during a micro-batch records no update. Each update is recorded with
// the momentum forward used, read from the layer's options at each
// micro-batch, so a momentum schedule is followed. A layer run twice in one
// micro-batch would leave two updates in one x, which the replay cannot
// separate: refused. So are SyncBatchNorm, whose forward communicates, and a
// cumulative average (momentum unset), whose factor depends on the count.

namespace {

// The layer's momentum now: forward reads it at each call, so a schedule
// that changes it between steps is followed.
double momentum_of(const torch::nn::BatchNormOptions& options, const std::string& label, const std::string& where) {
  TORCH_CHECK(options.momentum().has_value(), where, label, " keeps a cumulative average (momentum unset), "
              "whose factor depends on how many batches each rank counted. Give it a momentum (0.1 is BatchNorm's "
              "default).");
  return options.momentum().value();
}

template <typename Impl>
bool add_norm(const std::string& name, torch::nn::Module& module, std::vector<torch::Tensor>& tensors,
              torch::nn::BatchNormOptions*& options, const std::string& where) {
  auto* norm = module.as<Impl>();
  if (norm == nullptr) {
    return false;
  }
  if (!norm->options.track_running_stats()) {
    return true;
  }
  momentum_of(norm->options, "'" + name + "' (" + module.name() + ")", where);
  options = &norm->options;
  tensors = {norm->running_mean, norm->running_var, norm->num_batches_tracked};
  return true;
}

} // namespace

MicroBatchNorms::MicroBatchNorms(torch::nn::Module& module, const std::string& where) : where_(where) {
  std::unordered_set<const torch::nn::Module*> seen; // a layer registered under two names is one layer
  for (const auto& named : module.named_modules()) {
    const std::string name = named.key().empty() ? "the module" : named.key();
    auto& m = *named.value();
    if (!seen.insert(&m).second) {
      continue;
    }
    TORCH_CHECK(m.as<SyncBatchNormImpl>() == nullptr, where, "'", name, "' is a lockstep::SyncBatchNorm, whose "
                "statistics span the ranks' batches at each forward. Deterministic mode runs micro-batches alone: "
                "use torch::nn::BatchNorm, whose running statistics it keeps exact.");
    std::vector<torch::Tensor> tensors;
    torch::nn::BatchNormOptions* options = nullptr;
    if ((add_norm<torch::nn::BatchNorm1dImpl>(name, m, tensors, options, where) ||
         add_norm<torch::nn::BatchNorm2dImpl>(name, m, tensors, options, where) ||
         add_norm<torch::nn::BatchNorm3dImpl>(name, m, tensors, options, where)) &&
        !tensors.empty()) {
      norms_.push_back({name, &m, tensors[0], tensors[1], tensors[2], options});
      per_micro_batch_ += 2 + tensors[0].numel() + tensors[1].numel();
    }
  }
}

void MicroBatchNorms::start_step() {
  torch::NoGradGuard no_grad;
  start_mean_.clear(), start_var_.clear(), start_count_.clear(), recorded_.clear();
  for (const auto& n : norms_) {
    start_mean_.push_back(n.mean.clone());
    start_var_.push_back(n.var.clone());
    start_count_.push_back(n.count.clone());
  }
}

void MicroBatchNorms::begin() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < norms_.size(); ++i) {
    auto& n = norms_[i];
    if (n.module->is_training()) {
      n.mean.zero_();
      n.var.zero_();
    } else {
      n.mean.copy_(start_mean_[i]);
      n.var.copy_(start_var_[i]);
    }
    n.count.copy_(start_count_[i]);
  }
}

void MicroBatchNorms::end(int64_t k) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(recorded_.size()) == k);
  std::vector<double> record;
  for (size_t i = 0; i < norms_.size(); ++i) {
    const auto& n = norms_[i];
    const int64_t updates = (n.count - start_count_[i]).item<int64_t>();
    TORCH_CHECK(updates <= 1, where_, "'", n.name, "' ran ", updates, " times in micro-batch ", k, " of this rank. "
                "Deterministic mode replays each micro-batch's update of its running statistics, one per "
                "micro-batch. Run each BatchNorm once per forward, or put it in eval mode; under activation "
                "checkpointing, whose recomputation runs it again, keep BatchNorm out of the checkpointed segments.");
    record.push_back(static_cast<double>(updates));
    record.push_back(updates != 0 ? momentum_of(*n.options, "'" + n.name + "'", where_) : 0.0);
    for (const auto& t : {n.mean, n.var}) {
      const auto values = t.detach().to(torch::kDouble).cpu().contiguous();
      record.insert(record.end(), values.data_ptr<double>(), values.data_ptr<double>() + values.numel());
    }
  }
  recorded_.push_back(std::move(record));
}

void MicroBatchNorms::restore() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < norms_.size(); ++i) {
    norms_[i].mean.copy_(start_mean_[i]);
    norms_[i].var.copy_(start_var_[i]);
    norms_[i].count.copy_(start_count_[i]);
  }
}

bool MicroBatchNorms::tracks(const torch::Tensor& tensor) const {
  return std::any_of(norms_.begin(), norms_.end(), [&](const Norm& n) {
    return n.mean.is_same(tensor) || n.var.is_same(tensor) || n.count.is_same(tensor);
  });
}

std::vector<double> MicroBatchNorms::recorded(int64_t share) const {
  std::vector<double> all;
  for (const auto& record : recorded_) {
    all.insert(all.end(), record.begin(), record.end());
  }
  all.resize(static_cast<size_t>(share * per_micro_batch_), 0.0); // a failed step's micro-batches that did not run
  return all;
}

void MicroBatchNorms::replay(const std::vector<const double*>& records, int64_t share) {
  torch::NoGradGuard no_grad;
  restore();
  for (const double* rank_records : records) {
    for (int64_t k = 0; k < share; ++k) {
      const double* at = rank_records + k * per_micro_batch_;
      for (auto& n : norms_) {
        const bool updated = *at++ != 0;
        const double momentum = *at++; // the one forward's update used
        for (auto* t : {&n.mean, &n.var}) {
          if (updated) {
            auto x = torch::from_blob(const_cast<double*>(at), {t->numel()}, torch::kDouble).to(t->options());
            t->mul_(1 - momentum).add_(x.view_as(*t));
          }
          at += t->numel();
        }
        n.count.add_(updated ? 1 : 0);
      }
    }
  }
}

} // namespace detail
} // namespace lockstep
