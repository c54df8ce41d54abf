// Stages 1 to 4 of Note [DataParallel step], and what stage 5 is built
// from; the node itself is in parallel_backward.cpp.

#include <lockstep/data_parallel.h>

#include "deterministic/micro_batch_step.h"
#include "dp/parallel_backward.h"
#include "dp/worker_pool.h"
#include "util/torch_compat.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <unordered_set>

namespace lockstep {

std::vector<torch::Device> default_devices() {
  std::vector<torch::Device> devices;
  const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
  for (int64_t i = 0; i < gpus; ++i) {
    devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
  }
  if (devices.empty()) {
    devices.assign(kDefaultCpuReplicas, torch::Device(torch::kCPU));
  }
  return devices;
}

namespace detail {
namespace {

using torch::autograd::variable_list;

void check_tensors_on(
    const char* kind,
    const std::vector<std::string>& names,
    const std::vector<torch::Tensor>& tensors,
    torch::Device first) {
  for (size_t i = 0; i < names.size(); ++i) {
    const auto d = tensors[i].device();
    TORCH_CHECK(
        d.type() == first.type() && (!first.has_index() || d.index() == first.index()), "lockstep::DataParallel: ",
        kind, " '", names[i], "' is on ", d, " but devices[0] is ", first,
        ". The wrapped module must be on devices[0]: call module->to(", first,
        ") before wrapping it, or list its device first in devices().");
  }
}

// Makes `target` share `source`'s storage and version counter, unless it
// already does: an optimizer step on the wrapped module is then seen with no
// copy, and an in-place change between forward and backward is caught as it
// would be without the wrapper. Re-run after the source's storage changed
// (torch::load, to(kDouble)).
void alias(torch::Tensor& target, const torch::Tensor& source) {
  if (target.is_same(source) ||
      (target.data_ptr() == source.data_ptr() && target.sizes() == source.sizes() &&
       target.strides() == source.strides() && target.dtype() == source.dtype())) {
    return;
  }
  target.set_data(source.detach());
  target.unsafeGetTensorImpl()->set_version_counter(source.unsafeGetTensorImpl()->version_counter());
}

} // namespace

constexpr int64_t kMaxIntraOpThreads = 4096;

DataParallelOptions resolve_options(DataParallelOptions options) {
  if (options.devices().empty()) {
    options.devices(default_devices());
  }
  auto devices = options.devices();
  const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
  for (size_t r = 0; r < devices.size(); ++r) {
    if (devices[r].is_cuda()) {
      if (!devices[r].has_index()) {
        devices[r] = torch::Device(torch::kCUDA, 0);
      }
      TORCH_CHECK(
          devices[r].index() < gpus, "lockstep::DataParallel: devices[", r, "] is ", devices[r],
          " but this process sees ", gpus, " CUDA device(s). Pass existing devices, or torch::kCPU for CPU replicas.");
    }
  }
  options.devices(devices);
  if (options.output_device().has_value()) {
    auto out = *options.output_device();
    TORCH_CHECK(out.is_cpu() || out.is_cuda(), "lockstep::DataParallel: output_device is ", out, "; DataParallel "
                "gathers outputs on a CPU or a CUDA device.");
    if (out.is_cuda() && !out.has_index()) {
      options.output_device(torch::Device(torch::kCUDA, 0));
    }
    TORCH_CHECK(!out.is_cuda() || options.output_device()->index() < gpus, "lockstep::DataParallel: output_device is ",
                *options.output_device(), " but this process sees ", gpus, " CUDA device(s). Pass an existing "
                "device, or leave it unset for devices[0].");
  }
  // An int for OpenMP's thread count; more threads than any machine has
  // cores asks the OS for thousands of threads.
  TORCH_CHECK(
      options.intra_op_threads() >= 0 && options.intra_op_threads() <= kMaxIntraOpThreads,
      "lockstep::DataParallel: intra_op_threads must be from 0 (0 splits the cores) to ", kMaxIntraOpThreads,
      ", but got ", options.intra_op_threads(), ".");
  chunk_sizes(1, static_cast<int64_t>(devices.size()), options.weights()); // checks the weights
  if (!options.deterministic()) {
    check_no_micro_batch_options({options.micro_batches(), options.micro_batch_size(), options.seed()},
                                 "lockstep::DataParallel: ", "DataParallelOptions");
  }
  return options;
}

void check_module_on(const torch::nn::Module& module, torch::Device first) {
  for (const auto& [kind, named] :
       {std::make_pair("parameter", module.named_parameters()), std::make_pair("buffer", module.named_buffers())}) {
    check_tensors_on(kind, named.keys(), named.values(), first);
  }
}

DataParallelCore::DataParallelCore(
    std::shared_ptr<torch::nn::Module> source,
    std::vector<std::shared_ptr<torch::nn::Module>> replicas,
    DataParallelOptions options)
    : source_(std::move(source)), replicas_(std::move(replicas)), options_(std::move(options)) {
  const auto& devices = options_.devices();
  TORCH_INTERNAL_ASSERT(replicas_.size() == devices.size() && !devices.empty());
  for (const auto& named : source_->named_parameters()) {
    param_names_.push_back(named.key());
    source_params_.push_back(named.value());
  }
  for (const auto& named : source_->named_buffers()) {
    buffer_names_.push_back(named.key());
    source_buffers_.push_back(named.value());
  }
  source_modules_ = source_->modules();
  for (size_t m = 0; m < source_modules_.size(); ++m) { // named_buffers()'s order: its modules' in pre-order
    buffer_owners_.insert(buffer_owners_.end(), source_modules_[m]->named_buffers(/*recurse=*/false).size(), m);
  }
  TORCH_INTERNAL_ASSERT(buffer_owners_.size() == source_buffers_.size());
  for (const auto& replica : replicas_) {
    replica_modules_.push_back(replica->modules());
    TORCH_INTERNAL_ASSERT(replica_modules_.back().size() == source_modules_.size());
    params_.push_back(replica->parameters());
    buffers_.push_back(replica->buffers());
    TORCH_INTERNAL_ASSERT(params_.back().size() == param_names_.size());
    TORCH_INTERNAL_ASSERT(buffers_.back().size() == buffer_names_.size());
  }
  check_on_first_device();

  // See Note [CPU replicas and threads] below.
  int64_t cpu_replicas = 0;
  for (const auto& d : devices) {
    cpu_replicas += d.is_cpu();
  }
  const int64_t cores = std::max(1, at::get_num_threads());
  std::vector<int> threads;
  int64_t cpu_seen = 0;
  for (const auto& d : devices) {
    int64_t t = 1;
    if (d.is_cpu()) {
      t = options_.intra_op_threads() > 0
          ? options_.intra_op_threads()
          : std::max<int64_t>(1, cores / cpu_replicas + (cpu_seen < cores % cpu_replicas ? 1 : 0));
      ++cpu_seen;
    }
    threads.push_back(static_cast<int>(t));
  }
  if (devices.size() > 1 || output_device() != devices[0]) {
    pool_ = std::make_shared<WorkerPool>(threads, /*cache_cpu_memory=*/cpu_replicas > 0);
  }
  for (size_t r = 0; r < replicas_.size(); ++r) {
    sync_params(r); // replicas on devices[0] drop their cloned storage at once
  }
  alias_replica0_buffers();
}

// Note [Replica 0]
// ~~~~~~~~~~~~~~~~
// Replica 0 is a clone of the wrapped module, like the others, not the module
// itself (unless it runs alone, without threads: then it is the module). Its
// parameters and buffers are separate tensors that share the module's storage
// and version counters, so optimizer steps and BatchNorm's running statistics
// reach the module with no copy. It has to be separate: ParallelBackward asks
// autograd::grad for each replica's parameter gradients, and since PyTorch 2.0
// that capture runs the captured leaf's tensor hooks. If replica 0's
// parameters were the module's, a hook the user put on one would run twice,
// once on replica 0's share and once on the sum, and a hook that changes the
// gradient would change it twice. With a separate leaf per replica, the only
// hooks that run are the module's, once, on the summed gradient, in
// AccumulateGrad, as without the wrapper, on every PyTorch version. The cost
// is one clone at construction, whose storage is dropped at once. State a
// module keeps in C++ members is therefore per replica: read it with
// map_replicas().
//
// Note [Replica parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A replica's parameters, and its buffers that require a gradient, are not
// leaves: each has a ReplicaToModule node as grad_fn, whose one edge leads to
// the wrapped module's tensor (src/dp/parallel_backward.h). This is what
// PyTorch's replicate() gets from Broadcast, without its per-call clone.
// ParallelBackward asks autograd::grad for the gradient at those tensors, so
// a first-order backward stops there and never runs the node. But when the
// caller's backward has create_graph=true, each replica's gradient is itself
// a graph over the replica's tensors; through the node it reaches the module's
// parameters, and through the inputs' non-leaf pieces (ReplicaScatter::take)
// the caller's inputs, so a gradient penalty's second backward lands in the
// module's .grad as it would without the wrapper
// (test_data_parallel_function_deletion). Buffers that require a gradient go
// the same way, their gradients summed over replicas like the parameters'
// (test_data_parallel_buffers_requiring_grad). The node is made once and
// reused while the shapes, devices and the module's gradient accumulator stay
// the same.

// Note [CPU replicas and threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Two replicas that each use every core run slower than one: they evict each
// other's caches and their OpenMP threads fight. So each CPU replica's worker
// sets its own intra-op thread count to its share of the caller's count
// (with 16 cores and 2 replicas, 8 each; with more replicas than cores, 1).
// LibTorch runs intra-op work on OpenMP, whose thread count is per calling
// thread, and the BLAS follows the same per-thread count: Debian's OpenMP
// build of OpenBLAS (scripts/setup.sh selects it) reads it, and the pip
// wheel's MKL is given it by at::set_num_threads (mkl_set_num_threads_local).
// The caller keeps its own count, so what it runs between steps (the
// optimizer, a bare module) has every core.
//
// Then libgomp's spin. After each parallel region a thread's idle team keeps
// spinning for milliseconds, unless OMP_WAIT_POLICY=passive, which libgomp
// reads once at start-up and a library cannot set. The caller's optimizer
// step is such a region, and its spinning helpers took the cores the
// replicas' forward needed. So the idle teams end at every hand-off
// (release_idle_openmp_team, src/dp/cpu_threads.h, OpenMP 5.0's
// omp_pause_resource_all): the caller's before its replicas start, and each
// worker's (it has one where its share is more than one thread, or the
// replica's code set a count) before it reports its replica done. No thread
// then spins on a core another needs; the price is a team started again at
// the next parallel region, thread starts instead of milliseconds of spinning.
// The caller's team cannot do the replicas' work instead: inside its parallel
// region LibTorch runs every op on one thread, so with more cores than
// replicas each replica would lose its share.
//
// Then memory. Each worker's glibc arena gives its free memory back to the
// kernel every step, and the next step page-faults all of it in again: enough
// to keep DataParallel at two thirds of its ceiling on the MLP, and to make it
// swing from run to run. So the replicas keep their memory (Note [CPU
// replicas' memory] in src/util/cpu_cache.cpp). And the gradient sums are shared
// out by size (assign_sums), so that no worker sums the largest layers alone
// while the others wait. Measured in docs/performance.md
// ("DataParallel").

torch::Device DataParallelCore::output_device() const {
  return options_.output_device().value_or(options_.devices()[0]);
}

void DataParallelCore::check_on_first_device() const {
  check_tensors_on("parameter", param_names_, source_params_, options_.devices()[0]);
  check_tensors_on("buffer", buffer_names_, source_buffers_, options_.devices()[0]);
}

// The replicas are clones of the module as it was wrapped. A load or .to()
// keeps each tensor (it sets its data), but a replaced submodule or a newly
// registered tensor would be silently left out: the replicas would go on
// computing with the old ones, and the new ones would get no gradient.
void DataParallelCore::check_unchanged() const {
  const auto same_tensors = [](const std::vector<torch::Tensor>& now, const std::vector<torch::Tensor>& then) {
    return std::equal(now.begin(), now.end(), then.begin(), then.end(), [](const auto& a, const auto& b) {
      return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
    });
  };
  const auto modules = source_->modules();
  const char* what = !same_tensors(source_->parameters(), source_params_)  ? "its parameters"
                     : !same_tensors(source_->buffers(), source_buffers_) ? "its buffers"
                     : !std::equal(modules.begin(), modules.end(), source_modules_.begin(), source_modules_.end())
                         ? "its submodules"
                         : nullptr;
  TORCH_CHECK(what == nullptr, "lockstep::DataParallel: the wrapped module changed after it was wrapped (", what,
              " are not the ones it had then: a submodule replaced, or a parameter or buffer registered). "
              "The replicas were made from the module as it was, and would go on with the old ones. Wrap the "
              "module again after changing it, and make the optimizer over the new wrapper's parameters.");
}

Plan DataParallelCore::plan(const SplitSites& sites) const {
  Plan plan;
  plan.batch = batch_size_of(sites);
  plan.sizes = chunk_sizes(plan.batch, static_cast<int64_t>(size()), options_.weights());
  int64_t offset = 0;
  for (size_t r = 0; r < plan.sizes.size(); ++r) {
    plan.offsets.push_back(offset);
    offset += plan.sizes[r];
    // An empty batch runs on replica 0, with its 0 rows, so the answer is
    // the bare module's (an empty output, or the module's own error).
    if (plan.sizes[r] > 0 || (plan.batch == 0 && r == 0)) {
      plan.used.push_back(r);
    }
  }
  return plan;
}

void DataParallelCore::sync_params(size_t r) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < source_params_.size(); ++i) {
    const auto& source = source_params_[i];
    auto& target = params_[r][i];
    if (target.device() == source.device()) {
      alias(target, source);
    } else if (target.sizes() == source.sizes() && target.dtype() == source.dtype()) {
      // Every call, as PyTorch's DataParallel broadcasts every forward: no
      // counter tells when to skip it, since LibTorch's SGD and torch::load
      // write through .data() and set_data, which move no version counter.
      // Through .data() itself, so that a forward that saved this tensor for
      // a backward still to come (two forwards, one backward) is not told
      // it was modified in place by a copy of the same values.
      target.data().copy_(source);
    } else {
      target.set_data(source.to(target.device(), source.scalar_type(), false, /*copy=*/true));
    }
    link_to_module(target, source);
  }
}

void DataParallelCore::alias_replica0_buffers() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < source_buffers_.size(); ++i) {
    alias(buffers_[0][i], source_buffers_[i]);
    link_to_module(buffers_[0][i], source_buffers_[i]);
  }
}

// Note [BufferSync::Off in eval mode]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Off lets each replica keep the buffers it updates in training. A module
// in eval mode updates none, and a replica that kept its own there would
// answer its rows with other running statistics than the wrapped module's
// (or than a checkpoint loaded after wrapping): one batch, two models. So
// the buffers of modules in eval mode are the wrapped module's in every
// replica, whatever BufferSync says; a buffer that needs a gradient is an
// input, as a parameter is, and is copied too.
void DataParallelCore::sync_buffers(size_t r) {
  torch::NoGradGuard no_grad;
  const bool all = options_.buffers() != BufferSync::Off;
  for (size_t i = 0; i < source_buffers_.size(); ++i) {
    const auto& source = source_buffers_[i];
    auto& target = buffers_[r][i];
    if (!all && !source.requires_grad() && source_modules_[buffer_owners_[i]]->is_training()) {
      continue;
    }
    if (target.sizes() == source.sizes() && target.dtype() == source.dtype()) {
      target.data().copy_(source); // .data(): as sync_params, for two forwards before one backward
    } else {
      target.set_data(source.to(target.device(), source.scalar_type(), false, /*copy=*/true));
    }
    link_to_module(target, source);
  }
}

// Each module's train()/eval(), not only the root's: fine-tuning often
// freezes BatchNorm with net->bn->eval() inside a model in training mode. In
// pre-order, a module set after its parent keeps its own mode.
void DataParallelCore::mirror_modes(size_t r) {
  const auto& theirs = replica_modules_[r];
  for (size_t i = 0; i < source_modules_.size(); ++i) {
    const bool training = source_modules_[i]->is_training();
    if (theirs[i]->is_training() != training) {
      theirs[i]->train(training);
    }
  }
}

DataParallelCore::ForwardGuard::ForwardGuard(std::atomic<bool>& running) : running_(running) {
  TORCH_CHECK(!running_.exchange(true), "lockstep::DataParallel: forward was called while another forward of this "
              "DataParallel runs (from another thread, or from inside its own module's forward). Its replicas hold "
              "one step's parameters, buffers and inputs at a time: call it from one thread, or give each thread a "
              "DataParallel over a module of its own.");
}

void DataParallelCore::prepare_forward(const Plan& plan) {
  check_unchanged();
  check_on_first_device();
  for (size_t r : plan.used) {
    if (replicas_[r] != source_) {
      mirror_modes(r);
    }
    sync_params(r);
    if (r == 0) {
      alias_replica0_buffers(); // replica 0's buffer updates are the module's
    } else {
      sync_buffers(r);
    }
  }
}

StepInputs DataParallelCore::apply(const Plan& plan, const std::function<void(size_t, ReplicaScatter&)>& fn) {
  TORCH_INTERNAL_ASSERT(pool_);
  StepInputs inputs;
  inputs.leaves.assign(size(), {});
  std::vector<ReplicaScatter> scatters(size());
  for (size_t r : plan.used) {
    auto& s = scatters[r];
    s.device = options_.devices()[r];
    s.dim = options_.dim();
    s.offset = plan.offsets[r];
    s.size = plan.sizes[r];
    s.track_grad = torch::GradMode::is_enabled();
    s.leaves = &inputs.leaves[r];
    s.sources = r == plan.used.front() ? &inputs.sources : nullptr;
  }
  detail::map_replicas(*pool_, plan.used, options_.devices(), "forward", [&](size_t r) { fn(r, scatters[r]); });
  check_shared_unchanged(plan, scatters);
  return inputs;
}

// Note [A broadcast tensor changed in forward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor passed whole (lockstep::broadcast) reaches every replica on its
// own device as the caller's tensor itself: CPU replicas share it, and
// replicas on other GPUs copy it while they start. One that changes it in
// place (h.mul_(2)) changes it under the others, in whatever order the
// threads run: on 4 CPU replicas the bare module's 2 became 16. Copying it
// for every replica would cost every read-only use a copy per step; each
// replica notes its version instead, before its forward runs, and a change
// is an error after them.
void DataParallelCore::check_shared_unchanged(const Plan& plan, const std::vector<ReplicaScatter>& scatters) const {
  for (size_t r : plan.used) {
    for (const auto& [tensor, version] : scatters[r].shared) {
      TORCH_CHECK(tensor._version() == version, "lockstep::DataParallel: a tensor passed whole "
                  "(lockstep::broadcast) was changed in place during forward. Every replica on ",
                  options_.devices()[r], " receives that one tensor, so the replicas changed it under each other and "
                  "their results depend on the threads' timing. Change a copy in forward (t = t.clone()), or pass it "
                  "split.");
    }
  }
}

namespace {

// Indices of the tensors that need a gradient.
std::vector<size_t> needing_grad(const std::vector<torch::Tensor>& tensors) {
  std::vector<size_t> indices;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].requires_grad()) {
      indices.push_back(i);
    }
  }
  return indices;
}

// The tensors of `tensors` at `indices`, appended to `out` in that order.
void append_picked(std::vector<torch::Tensor>& out, const std::vector<torch::Tensor>& tensors,
                   const std::vector<size_t>& indices) {
  for (size_t i : indices) {
    out.push_back(tensors[i]);
  }
}

// How `source` reached the replicas that `plan` runs, for ParallelBackward
// to cut its gradient back.
InputMeta input_meta(const InputSource& source, const Plan& plan) {
  InputMeta meta;
  meta.split = source.split;
  meta.dim = source.dim;
  meta.options = source.tensor.options();
  meta.shape = source.tensor.sizes().vec();
  for (size_t r : plan.used) {
    meta.sizes.push_back(plan.sizes[r]);
  }
  return meta;
}

} // namespace

void DataParallelCore::average_buffers(const Plan& plan) {
  torch::NoGradGuard no_grad;
  const size_t first = plan.used.front();
  if (options_.buffers() == BufferSync::Broadcast && first != 0) {
    // Under Broadcast the module keeps replica 0's updates, through the
    // storage they share; with weights replica 0 can get no rows, and the
    // first replica that ran stands in for it.
    for (size_t b = 0; b < source_buffers_.size(); ++b) {
      if (!source_buffers_[b].requires_grad()) {
        source_buffers_[b].data().copy_(buffers_[first][b]);
      }
    }
    return;
  }
  if (options_.buffers() != BufferSync::Average || !source_->is_training()) {
    return;
  }
  // A submodule in eval mode inside a training one (a frozen BatchNorm)
  // keeps its statistics: averaging equal copies by shares would still
  // move them by a rounding each step.
  std::unordered_set<const c10::TensorImpl*> frozen;
  for (const auto& module : source_->modules(/*include_self=*/false)) {
    if (!module->is_training()) {
      for (const auto& buffer : module->buffers(/*recurse=*/false)) {
        frozen.insert(buffer.unsafeGetTensorImpl());
      }
    }
  }
  for (size_t b = 0; b < source_buffers_.size(); ++b) {
    auto& target = source_buffers_[b];
    if (!at::isFloatingType(target.scalar_type()) || target.requires_grad() ||
        frozen.count(target.unsafeGetTensorImpl()) > 0) {
      // Counters such as num_batches_tracked move in step on every replica;
      // a buffer that needs a gradient is a leaf forward cannot change.
      continue;
    }
    torch::Tensor total;
    for (size_t r : plan.used) {
      const double share = plan.batch == 0 ? 1.0 : static_cast<double>(plan.sizes[r]) / static_cast<double>(plan.batch);
      auto term = buffers_[r][b].to(target.device()) * share;
      total = total.defined() ? total + term : term;
    }
    // Through .data(): BatchNorm saves its running stats for backward without
    // reading them in training mode, and a version bump here would make that
    // backward fail.
    target.data().copy_(total);
  }
}

void DataParallelCore::attach_backward(
    const Plan& plan,
    const std::vector<std::vector<torch::Tensor>>& flat,
    Gathered& gathered,
    StepInputs&& inputs) {
  if (gathered.differentiable.empty()) {
    return;
  }
  BackwardPlan backward;
  backward.pool = pool_;
  backward.devices = options_.devices();
  backward.outputs = std::move(gathered.specs);
  // The node's outputs, in order: parameters and buffers that need a
  // gradient (PyTorch's replicate() broadcasts those buffers differentiably,
  // so their gradients sum back too), then inputs.
  const auto grad_params = needing_grad(source_params_);
  const auto grad_buffers = needing_grad(source_buffers_);
  append_picked(backward.params, source_params_, grad_params);
  append_picked(backward.params, source_buffers_, grad_buffers);
  variable_list next_edges = backward.params;
  for (const auto& source : inputs.sources) {
    backward.inputs.push_back(input_meta(source, plan));
    next_edges.push_back(source.tensor);
  }
  for (size_t i = 0; i < plan.used.size(); ++i) {
    const size_t r = plan.used[i];
    ReplicaGraph graph;
    graph.replica = r;
    graph.device = options_.devices()[r];
    for (size_t j : gathered.differentiable) {
      const auto& t = flat[i][j];
      graph.outputs.push_back(t.requires_grad() ? t : torch::Tensor());
    }
    append_picked(graph.params, params_[r], grad_params);
    append_picked(graph.params, buffers_[r], grad_buffers);
    graph.leaves = std::move(inputs.leaves[r]);
    TORCH_INTERNAL_ASSERT(graph.leaves.size() == inputs.sources.size());
    backward.replicas.push_back(std::move(graph));
  }
  auto node = make_node<ParallelBackward>(std::move(backward));
  node->set_next_edges(torch::autograd::collect_next_edges(next_edges));
  for (size_t j : gathered.differentiable) {
    torch::autograd::set_history(gathered.tensors[j], node);
  }
}

void DataParallelCore::map_replicas(const std::function<void(size_t)>& fn) {
  if (!pool_) {
    fn(0);
    return;
  }
  std::vector<size_t> all(size());
  for (size_t r = 0; r < all.size(); ++r) {
    all[r] = r;
  }
  detail::map_replicas(*pool_, all, options_.devices(), "map_replicas", fn);
}

void DataParallelCore::train(bool on) {
  for (auto& replica : replicas_) {
    if (replica != source_) {
      replica->train(on);
    }
  }
}

void DataParallelCore::to_dtype(torch::Dtype dtype, bool non_blocking) {
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (replicas_[r] != source_) {
      replicas_[r]->to(dtype, non_blocking);
      sync_params(r);
    }
  }
  alias_replica0_buffers();
}

} // namespace detail
} // namespace lockstep
