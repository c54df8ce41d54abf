#include <lockstep/distributed_data_parallel.h>
#include <lockstep/sync_batch_norm.h>

#include "comm/collective_fingerprint.h"
#include "comm/rank0_text.h"
#include "deterministic/micro_batch_step.h"
#include "ddp/reducer.h"
#include "util/row_layout.h"
#include "util/sparse_embeddings.h"
#include "util/bucket_key.h"
#include "util/unique_tensors.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_set>

namespace lockstep {
namespace detail {
namespace {

// What the ranks compare of a parameter: its shape, dtype and, where it is
// not row-major, the layout of its bucket slot, which is the order its
// gradient's elements take in the allreduce (slot_strides).
std::string describe(const std::string& name, const torch::Tensor& p) {
  std::ostringstream out;
  out << "'" << name << "' " << p.sizes() << " " << p.scalar_type();
  const auto strides = slot_strides(p);
  if (c10::IntArrayRef(strides) != c10::IntArrayRef(c10::contiguous_strides(p.sizes()))) {
    out << " laid out with strides " << c10::IntArrayRef(strides);
  }
  return out.str();
}

// Autograd runs each device's gradient accumulators on that device's own
// thread, beside the CPU's, and the reducer's hooks share its state
// without a lock: a module split over devices would race on its buckets.
void check_one_device(const std::vector<std::string>& names, const std::vector<torch::Tensor>& params, int rank) {
  for (size_t i = 1; i < params.size(); ++i) {
    TORCH_CHECK(params[i].device() == params[0].device(), "lockstep::DistributedDataParallel: rank ", rank,
                ": the module's parameters are on more than one device ('", names[0], "' on ", params[0].device(),
                ", '", names[i], "' on ", params[i].device(), "), but DistributedDataParallel reduces the parameters "
                "of one device per rank. Move the module to one device (module->to(device)) before wrapping it, and "
                "run one process per device.");
  }
}

// What every rank's reducer and forward must agree on, or their collectives
// differ: bucket sizes set the allreduce sizes, the others add collectives.
std::string describe(const DistributedOptions& options) {
  std::ostringstream out;
  out << "bucket_bytes=" << options.bucket_bytes() << ", first_bucket_bytes=" << options.first_bucket_bytes()
      << ", find_unused_parameters=" << options.find_unused_parameters() << ", static_graph=" << options.static_graph()
      << ", broadcast_buffers=" << options.broadcast_buffers() << ", rebuild_buckets=" << options.rebuild_buckets()
      << ", comm_hook=" << (options.comm_hook() ? "set" : "none") << ", deterministic=" << options.deterministic()
      << ", micro_batches=" << options.micro_batches() << ", micro_batch_size=" << options.micro_batch_size()
      << ", seed=" << options.seed();
  return out.str();
}

} // namespace

int64_t verify_same_parameters(
    const ProcessGroup& group,
    const std::vector<std::string>& names,
    const std::vector<torch::Tensor>& params,
    const std::string& options) {
  // Line 0 is the options, line i + 1 parameter i.
  std::vector<std::string> mine{options};
  std::string text = options + "\n";
  for (size_t i = 0; i < params.size(); ++i) {
    mine.push_back(describe(names[i], params[i]));
    text += mine.back() + "\n";
  }
  // On the parameters' device: NCCL takes CUDA tensors only.
  const auto device = params.empty() ? torch::Device(torch::kCPU) : params[0].device();
  const auto reference = split_lines(
      rank0_text(group, text, device, "the check that every rank has rank 0's parameters and options"));

  int64_t first_difference = -1;
  for (size_t i = 0; i < std::max(mine.size(), reference.size()); ++i) {
    if (i >= mine.size() || i >= reference.size() || mine[i] != reference[i]) {
      first_difference = static_cast<int64_t>(i);
      break;
    }
  }
  // Every rank learns every rank's verdict, so that all of them throw.
  auto verdicts = group.all_gather(
      torch::tensor({first_difference, static_cast<int64_t>(mine.size()), propose_model_number()}, torch::kLong)
          .to(device));
  for (int r = 0; r < group.size(); ++r) {
    const auto verdict = verdicts[r].cpu();
    const auto index = verdict[0].item<int64_t>();
    const auto count = verdict[1].item<int64_t>();
    if (index < 0) {
      continue;
    }
    if (index == 0) {
      TORCH_CHECK(false, "lockstep::DistributedDataParallel: rank ", group.rank(), ": rank ", r,
                  "'s DistributedOptions differ from rank 0's: rank 0 has ", reference.empty() ? "none" : reference[0],
                  r == group.rank() ? ", this rank has " + mine[0] : std::string(" (its own error says what it has)"),
                  ". These set the size and number of the collectives, so every rank must pass the same ones.");
    }
    const int64_t param = index - 1;
    const std::string rank0 = index < static_cast<int64_t>(reference.size())
        ? reference[index]
        : "no parameter " + std::to_string(param) + " (it has " + std::to_string(reference.size() - 1) + ")";
    std::string theirs;
    if (r == group.rank()) {
      theirs = index < static_cast<int64_t>(mine.size()) ? mine[index]
                                                          : "no parameter " + std::to_string(param) + " (it has " + std::to_string(count - 1) + ")";
    } else {
      theirs = "something else (its own error says what)";
    }
    TORCH_CHECK(false, "lockstep::DistributedDataParallel: rank ", group.rank(), ": rank ", r,
                "'s parameters differ from rank 0's at parameter ", param, ": rank 0 has ", rank0, ", rank ", r, " has ",
                theirs, ". Every rank must build the same model, with the same parameters in the same order and "
                "memory format.");
  }
  return verdicts[0].cpu()[2].item<int64_t>();
}

namespace {

// Note [Buffers synced without a version bump]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A forward's BatchNorm saves its running statistics for backward, and
// autograd refuses a backward whose saved tensors' version counters moved.
// A second forward before that backward (a GAN's real and fake batches
// summed into one loss, a target computed under no grad) syncs the buffers
// again, in place: written through the tensor itself, that moves their
// counters, and the first forward's backward failed ("modified by an
// inplace operation"). PyTorch's DDP syncs them under
// _unsafe_preserve_version_counter; here they are written through another
// tensor over the same memory, whose counter is its own. BatchNorm's
// backward in training reads its saved batch statistics, not these.
void copy_keeping_version(const torch::Tensor& target, const torch::Tensor& source) {
  if (target.numel() == 0) {
    return; // nothing to copy, and from_blob would have no memory to place
  }
  if (target.layout() != torch::kStrided) {
    target.copy_(source);
    return;
  }
  torch::from_blob(target.data_ptr(), target.sizes(), target.strides(), target.options()).copy_(source);
}

} // namespace

void broadcast_coalesced(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors, int root,
                         const std::string& what, bool keep_versions) {
  if (tensors.empty()) {
    return;
  }
  torch::NoGradGuard no_grad;
  std::map<std::string, std::vector<torch::Tensor>> by_kind;
  for (const auto& t : tensors) {
    by_kind[bucket_key(t.scalar_type(), t.device())].push_back(t);
  }
  for (auto& [kind, group_tensors] : by_kind) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : group_tensors) {
      flat_parts.push_back(t.reshape({-1}));
    }
    auto flat = torch::cat(flat_parts);
    group.broadcast_async({flat}, root, what)->wait();
    int64_t offset = 0;
    for (auto& t : group_tensors) {
      const auto part = flat.narrow(0, offset, t.numel()).view(t.sizes());
      keep_versions ? copy_keeping_version(t, part) : void(t.copy_(part));
      offset += t.numel();
    }
  }
}

namespace {

// What backward would otherwise refuse at the first backward, after earlier
// buckets went out and leaving the wrapper unusable: a sparse gradient, and
// a dtype the backend cannot sum in the built-in allreduce (a bfloat16 model
// on 1.13's Gloo). A hook reduces as it likes; deterministic mode sums
// integers.
void check_dense_and_summable(torch::nn::Module& module, const ProcessGroup& group,
                              const std::vector<std::string>& names, const std::vector<torch::Tensor>& params,
                              const DistributedOptions& options) {
  const auto sparse = first_sparse_embedding(module);
  TORCH_CHECK(!sparse, "lockstep::DistributedDataParallel: '", *sparse, "' is an Embedding with sparse(true), whose "
              "gradient is sparse, and DistributedDataParallel reduces dense gradients only. Construct it with "
              "sparse(false).");
  if (options.comm_hook() || options.deterministic()) {
    return;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto dtype = params[i].scalar_type();
    const auto device = params[i].device();
    if (!group.supports(Collective::Allreduce, torch::kFloat, device) ||
        group.supports(Collective::Allreduce, dtype, device)) {
      continue; // a device the backend does not take at all: the collective's own refusal says what to do
    }
    const bool half = dtype == torch::kHalf || dtype == torch::kBFloat16;
    TORCH_CHECK(false, "lockstep::DistributedDataParallel: rank ", group.rank(), ": parameter '", names[i], "' is ",
                dtype, ", which the ", group.backend(), " backend cannot sum on ", device, ". ",
                half ? std::string("Keep the parameters in float32 and compute in ") + c10::toString(dtype) +
                        " under lockstep::AutocastGuard, or sum them in float32 with DistributedOptions().comm_hook("
                        "lockstep::comm_hooks::" + (dtype == torch::kHalf ? "fp16" : "bf16") + "_compress)."
                     : std::string("Register it in a type the backend sums (a complex parameter as real, "
                                   "torch::view_as_real, viewed as complex in forward)."));
  }
}

} // namespace

DistributedCore::DistributedCore(torch::nn::Module& module, ProcessGroup group, const DistributedOptions& options)
    : module_(module),
      group_(std::move(group)),
      broadcast_buffers_(options.broadcast_buffers()),
      has_comm_hook_(static_cast<bool>(options.comm_hook())) {
  TORCH_CHECK(options.bucket_bytes() > 0 && options.first_bucket_bytes() > 0,
              "lockstep::DistributedDataParallel: bucket_bytes and first_bucket_bytes must be > 0, but got ",
              options.bucket_bytes(), " and ", options.first_bucket_bytes(), ".");
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  const auto named = module.named_parameters();
  for (size_t i : first_occurrences(named.values())) {
    if (named[i].value().requires_grad()) {
      names.push_back(named[i].key());
      params.push_back(named[i].value());
    } else {
      frozen_.emplace_back(named[i].key(), named[i].value());
    }
  }
  TORCH_CHECK(!params.empty(), "lockstep::DistributedDataParallel: the module has no parameter that requires a "
              "gradient, so there is nothing to reduce.");
  check_one_device(names, params, group_.rank());
  Reducer::check_not_reduced(params, names, group_.rank());
  model_ = verify_same_parameters(group_, names, params, describe(options));
  check_dense_and_summable(module, group_, names, params, options); // the same on every rank, checked just above
  buffers_ = unique_tensors(module.buffers());
  detail::label_sync_batch_norms(module, group_, model_);
  broadcast_coalesced(group_, synced_state(), 0, "the broadcast of rank 0's parameters and buffers");
  if (options.deterministic()) {
    make_deterministic(std::move(params), options);
  } else {
    check_no_micro_batch_options({options.micro_batches(), options.micro_batch_size(), options.seed()},
                                 "lockstep::DistributedDataParallel: ", "DistributedOptions");
    reducer_ = std::make_unique<Reducer>(std::move(params), std::move(names), group_, options, model_);
  }
}

DistributedCore::~DistributedCore() = default;

std::vector<std::vector<size_t>> DistributedCore::buckets() const {
  return reducer_ ? reducer_->buckets() : std::vector<std::vector<size_t>>{};
}

// The parameters, and the buffers unless broadcast_buffers(false) keeps
// each rank's own (as PyTorch's _sync_module_states).
std::vector<torch::Tensor> DistributedCore::synced_state() const {
  auto everything = module_.parameters();
  if (broadcast_buffers_) {
    everything.insert(everything.end(), buffers_.begin(), buffers_.end());
  }
  return unique_tensors(everything);
}

void DistributedCore::check_still_frozen() const {
  for (const auto& [name, param] : frozen_) {
    TORCH_CHECK(!param.requires_grad(), "lockstep::DistributedDataParallel: rank ", group_.rank(), ": parameter '", name,
                "' was frozen (requires_grad false) when the module was wrapped and requires a gradient now. Which "
                "parameters train is fixed at wrapping: this one has no hook, so its gradient would stay local to each "
                "rank and the ranks' copies would drift apart. Set requires_grad before wrapping; to unfreeze it "
                "later, wrap the module again.");
  }
}

void DistributedCore::before_forward(int64_t batch) {
  if (micro_batches_) {
    TORCH_CHECK(sync_, "lockstep::DistributedDataParallel: rank ", group_.rank(), ": no_sync() has no use in "
                "deterministic mode, where backward_micro_batches accumulates a step's micro-batches itself.");
    check_still_frozen();
    micro_batches_->check_forward(batch);
    return; // buffers stay as wrapping made them: the step's check compares them
  }
  reducer_->check_last_backward_finished();
  reducer_->check_hooks_attached();
  check_still_frozen();
  CollectiveTag tag(model_tag(model_, 0)); // Note [Collective tags]: join's rounds, the buckets' rebuild, the buffers
  const bool grad = torch::GradMode::is_enabled();
  const bool reduce = sync_ && grad;
  int root = 0;
  if (joining_) {
    root = join_forward_round(reduce); // Note [Join] in src/ddp/join.cpp
  }
  if (reduce && reducer_->rebuild_pending()) {
    reducer_->rebuild_buckets(root);
  }
  if (broadcast_buffers_ && sync_) {
    broadcast_coalesced(group_, buffers_, root, "the broadcast of rank " + std::to_string(root) + "'s buffers",
                        /*keep_versions=*/true); // Note [Buffers synced without a version bump]
  }
  if (grad) {
    reducer_->prepare_for_backward(reduce);
  }
  // A forward without autograd makes no backward, so it leaves the reducer
  // as it was: a backward still to come from an earlier forward reduces as
  // that forward set (a target computed under NoGradGuard between a forward
  // and its backward, as PyTorch's DDP).
}

} // namespace detail
} // namespace lockstep
