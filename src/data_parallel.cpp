#include <lockstep/data_parallel.h>

#include "torch_compat.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/WrapDimUtils.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>

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

[[noreturn]] void throw_replica_error(size_t replica, torch::Device device, const char* stage, std::exception_ptr error) {
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    message = e.msg();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  TORCH_CHECK(false, "lockstep::DataParallel: replica ", replica, " on ", device, " failed in ", stage, ": ", message);
}

// Runs fn on the given replicas' workers with the caller's thread-local state
// (grad mode, inference mode, autocast, profiler), rethrowing the first error.
void run_replicas(
    WorkerPool& pool,
    const std::vector<size_t>& which,
    const std::vector<torch::Device>& devices,
    const char* stage,
    const std::function<void(size_t)>& fn) {
  at::ThreadLocalState state;
  for (size_t r : which) {
    if (devices[r].is_cpu()) {
      yield_caller_cores();
      break;
    }
  }
  auto errors = pool.run(which, [&](size_t r) {
    at::ThreadLocalStateGuard tls(state);
    c10::OptionalDeviceGuard device_guard;
    if (!devices[r].is_cpu()) {
      device_guard.reset_device(devices[r]);
    }
    fn(r);
  });
  for (size_t i = 0; i < which.size(); ++i) {
    if (errors[i]) {
      throw_replica_error(which[i], devices[which[i]], stage, errors[i]);
    }
  }
}

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

bool is_differentiable(const torch::Tensor& t) {
  return at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type());
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

// How one gathered output was made from the replicas' outputs, so that its
// gradient can be cut back into the replicas' pieces.
struct OutputSpec {
  enum class Kind { Cat, Stack, Weighted } kind = Kind::Cat;
  int64_t dim = 0;
  std::vector<int64_t> sizes; // Cat: per running replica, along dim
  std::vector<double> weights; // Weighted: per running replica
};

// What a replica's backward needs: its differentiable outputs (aligned with
// ParallelBackward's inputs, undefined where that replica's output needs no
// gradient), its parameters that need one, and its input leaves.
struct ReplicaGraph {
  size_t replica = 0;
  torch::Device device{torch::kCPU};
  std::vector<torch::Tensor> outputs;
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> leaves;
};

struct InputMeta {
  bool split = true;
  int64_t dim = 0;
  std::vector<int64_t> sizes; // per running replica: rows of its chunk
  torch::TensorOptions options;
  std::vector<int64_t> shape;
};

// See Note [DataParallel step], stage 5.
class ParallelBackward : public torch::autograd::Node {
 public:
  std::string name() const override {
    return "lockstep::ParallelBackward";
  }

  void release_variables() override {
    graphs_.clear();
    released_ = true;
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(
        !released_,
        "lockstep::DataParallel: backward through the same DataParallel output a second time. "
        "Pass retain_graph=true to the first backward() if you need to go through it again.");
    TORCH_CHECK(
        !torch::GradMode::is_enabled(),
        "lockstep::DataParallel: backward with create_graph=true (double backward) is not supported.");
    TORCH_INTERNAL_ASSERT(grads.size() == specs_.size());
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();

    std::vector<variable_list> results(graphs_.size());
    auto backward_one = [&](size_t g) {
      ReplicaGraph& graph = graphs_[g];
      variable_list outputs, grad_outputs;
      for (size_t j = 0; j < specs_.size(); ++j) {
        if (!grads[j].defined() || !graph.outputs[j].defined()) {
          continue;
        }
        outputs.push_back(graph.outputs[j]);
        grad_outputs.push_back(piece(grads[j], specs_[j], g).to(graph.device));
      }
      variable_list inputs = graph.params;
      inputs.insert(inputs.end(), graph.leaves.begin(), graph.leaves.end());
      if (outputs.empty() || inputs.empty()) {
        return;
      }
      results[g] = torch::autograd::grad(outputs, inputs, grad_outputs, keep_graph, false, /*allow_unused=*/true);
    };

    // CPU replicas run their backward on their own workers, in parallel. The
    // engine runs a device's work on that device's engine thread, which is
    // the thread we are on when the output is on a GPU; so GPU replicas run
    // here, as reentrant backward, and cannot wait on themselves.
    std::vector<size_t> on_workers, worker_graph(devices_.size(), 0);
    for (size_t g = 0; g < graphs_.size(); ++g) {
      if (graphs_[g].device.is_cpu()) {
        on_workers.push_back(graphs_[g].replica);
        worker_graph[graphs_[g].replica] = g;
      } else {
        backward_one(g);
      }
    }
    if (!on_workers.empty()) {
      run_replicas(*pool_, on_workers, devices_, "backward", [&](size_t r) { backward_one(worker_graph[r]); });
    }
    if (!keep_graph) {
      release_variables();
    }
    return combine(results, on_workers);
  }

  std::shared_ptr<WorkerPool> pool_;
  std::vector<torch::Device> devices_;
  std::vector<OutputSpec> specs_;
  std::vector<ReplicaGraph> graphs_;
  std::vector<torch::Tensor> params_; // the wrapped module's, needing grad
  std::vector<InputMeta> inputs_;

 private:
  // Replica g's share of a gathered output's gradient.
  torch::Tensor piece(const torch::Tensor& grad, const OutputSpec& spec, size_t g) const {
    switch (spec.kind) {
      case OutputSpec::Kind::Cat: {
        int64_t offset = 0;
        for (size_t i = 0; i < g; ++i) {
          offset += spec.sizes[i];
        }
        return grad.narrow(spec.dim, offset, spec.sizes[g]);
      }
      case OutputSpec::Kind::Stack:
        return grad.select(0, static_cast<int64_t>(g));
      case OutputSpec::Kind::Weighted:
        return grad * spec.weights[g];
    }
    TORCH_INTERNAL_ASSERT(false);
  }

  // Sums parameter gradients over replicas and puts input gradients back
  // together, in the order of this node's next edges. The sums are spread
  // over the CPU workers: the calling thread has yielded its cores to them.
  variable_list combine(std::vector<variable_list>& results, const std::vector<size_t>& workers) const {
    const size_t n_params = params_.size();
    variable_list out(n_params + inputs_.size());
    // The sums go to the engine, so that tensor hooks on the parameters see
    // every gradient and AccumulateGrad runs as without the wrapper. The
    // engine adds into a defined .grad on the calling thread, alone (it gave
    // its cores to the replicas): a pass over every gradient that cost 15% of
    // an MLP step. So when .grad holds only zeros (zero_grad() without
    // set_to_none), the workers undefine it and the engine takes the sum
    // as the new .grad: the same values, no add. Reading for zeros is split
    // over the workers.
    auto sum_params = [&](size_t first, size_t stride) {
      for (size_t p = first; p < n_params; p += stride) {
        for (auto& result : results) {
          if (result.empty() || !result[p].defined()) {
            continue;
          }
          auto g = result[p].to(params_[p].device());
          out[p] = out[p].defined() ? out[p].add(g) : g;
        }
        auto& grad = params_[p].mutable_grad();
        if (out[p].defined() && grad.defined() && grad.layout() == torch::kStrided && !grad.requires_grad() &&
            !grad.any().item<bool>()) {
          grad.reset();
        }
      }
    };
    if (workers.size() > 1) {
      std::vector<size_t> slot(devices_.size(), 0);
      for (size_t i = 0; i < workers.size(); ++i) {
        slot[workers[i]] = i;
      }
      run_replicas(*pool_, workers, devices_, "backward", [&](size_t r) { sum_params(slot[r], workers.size()); });
    } else {
      sum_params(0, 1);
    }
    for (size_t s = 0; s < inputs_.size(); ++s) {
      const InputMeta& meta = inputs_[s];
      const auto device = meta.options.device();
      if (!meta.split) {
        for (auto& result : results) {
          if (!result.empty() && result[n_params + s].defined()) {
            auto g = result[n_params + s].to(device);
            out[n_params + s] = out[n_params + s].defined() ? out[n_params + s].add(g) : g;
          }
        }
        continue;
      }
      std::vector<torch::Tensor> pieces;
      bool any = false;
      for (size_t g = 0; g < results.size(); ++g) {
        if (!results[g].empty() && results[g][n_params + s].defined()) {
          pieces.push_back(results[g][n_params + s].to(device));
          any = true;
        } else {
          auto shape = meta.shape;
          shape[meta.dim] = meta.sizes[g];
          pieces.push_back(torch::zeros(shape, meta.options));
        }
      }
      if (any) {
        out[n_params + s] = torch::cat(pieces, meta.dim);
      }
    }
    return out;
  }

  bool released_ = false;
};

} // namespace

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
  TORCH_CHECK(
      options.intra_op_threads() >= 0,
      "lockstep::DataParallel: intra_op_threads must be >= 0 (0 splits the cores), but got ", options.intra_op_threads(),
      ".");
  chunk_sizes(1, static_cast<int64_t>(devices.size()), options.weights()); // checks the weights
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
  for (const auto& replica : replicas_) {
    params_.push_back(replica->parameters());
    buffers_.push_back(replica->buffers());
    TORCH_INTERNAL_ASSERT(params_.back().size() == param_names_.size());
    TORCH_INTERNAL_ASSERT(buffers_.back().size() == buffer_names_.size());
    synced_versions_.emplace_back(param_names_.size(), -1);
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
    pool_ = std::make_shared<WorkerPool>(threads);
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

// Note [CPU replicas and threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Two replicas that each use every core run slower than one: they evict each
// other's caches and their OpenMP threads fight. So each CPU replica's worker
// sets its own intra-op thread count to its share of the caller's count.
// LibTorch runs intra-op work on OpenMP, whose thread count is per calling
// thread, and the BLAS follows the same per-thread count: Debian's OpenMP
// build of OpenBLAS (scripts/setup.sh selects it) reads it, and the pip
// wheel's MKL is given it by at::set_num_threads (mkl_set_num_threads_local).
// Measured with the wheel: the workers start no OpenMP teams of their own.
//
// The calling thread is the other half of the story. After each parallel
// region, libgomp keeps that thread's team spinning for a while (about 14 ms
// on the machines we measured) waiting for more work; the caller's optimizer
// step is such a region, and its spinning threads then take cores from the
// replicas' forward. Halved throughput, measured. So whenever CPU replicas
// run, the calling thread drops to one intra-op thread (yield_caller_cores):
// while DataParallel drives training, its replicas own the cores. See
// docs/design.md.

torch::Device DataParallelCore::output_device() const {
  return options_.output_device().value_or(options_.devices()[0]);
}

void DataParallelCore::check_on_first_device() const {
  check_tensors_on("parameter", param_names_, source_params_, options_.devices()[0]);
  check_tensors_on("buffer", buffer_names_, source_buffers_, options_.devices()[0]);
}

Plan DataParallelCore::plan(const SplitSites& sites, const std::function<SplitSites()>& names) const {
  Plan plan;
  plan.batch = batch_size_of(sites, names);
  plan.sizes = chunk_sizes(plan.batch, static_cast<int64_t>(size()), options_.weights());
  int64_t offset = 0;
  for (size_t r = 0; r < plan.sizes.size(); ++r) {
    plan.offsets.push_back(offset);
    offset += plan.sizes[r];
    if (plan.sizes[r] > 0) {
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
    } else if (synced_versions_[r][i] != source._version() || target.sizes() != source.sizes() ||
               target.dtype() != source.dtype()) {
      if (target.sizes() == source.sizes() && target.dtype() == source.dtype()) {
        target.copy_(source);
      } else {
        target.set_data(source.to(target.device(), source.scalar_type(), false, /*copy=*/true));
      }
      synced_versions_[r][i] = source._version();
    }
    if (target.requires_grad() != source.requires_grad()) {
      target.requires_grad_(source.requires_grad());
    }
  }
}

void DataParallelCore::alias_replica0_buffers() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < source_buffers_.size(); ++i) {
    alias(buffers_[0][i], source_buffers_[i]);
  }
}

void DataParallelCore::sync_buffers(size_t r) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < source_buffers_.size(); ++i) {
    const auto& source = source_buffers_[i];
    auto& target = buffers_[r][i];
    if (target.sizes() == source.sizes() && target.dtype() == source.dtype()) {
      target.copy_(source);
    } else {
      target.set_data(source.to(target.device(), source.scalar_type(), false, /*copy=*/true));
    }
  }
}

void DataParallelCore::prepare_forward(const Plan& plan) {
  check_on_first_device();
  const bool training = source_->is_training();
  for (size_t r : plan.used) {
    if (replicas_[r]->is_training() != training) {
      replicas_[r]->train(training);
    }
    sync_params(r);
    if (r == 0) {
      alias_replica0_buffers(); // replica 0's buffer updates are the module's
    } else if (options_.buffers() != BufferSync::Off) {
      sync_buffers(r);
    }
  }
}

void DataParallelCore::apply(const Plan& plan, StepInputs& inputs, const std::function<void(size_t, ReplicaScatter&)>& fn) {
  TORCH_INTERNAL_ASSERT(pool_);
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
  run_replicas(*pool_, plan.used, options_.devices(), "forward", [&](size_t r) { fn(r, scatters[r]); });
}

std::vector<torch::Tensor> DataParallelCore::gather(
    const Plan& plan,
    std::vector<std::vector<torch::Tensor>>& flat,
    StepInputs&& inputs) {
  const size_t n = plan.used.size();
  TORCH_INTERNAL_ASSERT(flat.size() == n && n > 0);
  for (size_t i = 1; i < n; ++i) {
    TORCH_CHECK(
        flat[i].size() == flat[0].size(), "lockstep::DataParallel: replica ", plan.used[i], " returned ",
        flat[i].size(), " tensors but replica ", plan.used[0], " returned ", flat[0].size(),
        "; every replica must return the same structure.");
  }
  const auto out_device = output_device();
  std::vector<double> shares(n);
  for (size_t i = 0; i < n; ++i) {
    shares[i] = static_cast<double>(plan.sizes[plan.used[i]]) / static_cast<double>(plan.batch);
  }

  std::vector<torch::Tensor> gathered(flat[0].size());
  std::vector<size_t> differentiable;
  std::vector<OutputSpec> specs;
  for (size_t j = 0; j < gathered.size(); ++j) {
    std::vector<torch::Tensor> parts(n);
    bool needs_grad = false;
    for (size_t i = 0; i < n; ++i) {
      parts[i] = flat[i][j];
      TORCH_CHECK(
          parts[i].defined() == parts[0].defined() && (!parts[i].defined() || parts[i].dim() == parts[0].dim()),
          "lockstep::DataParallel: output tensor ", j, " of replica ", plan.used[i],
          " differs in rank or definedness from replica ", plan.used[0], "'s.");
      needs_grad = needs_grad || (parts[i].defined() && parts[i].requires_grad());
    }
    if (!parts[0].defined()) {
      continue;
    }
    OutputSpec spec;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : parts) {
        p = p.to(out_device);
      }
      if (parts[0].dim() == 0) {
        switch (options_.scalar_outputs()) {
          case ScalarGather::Stack:
            spec.kind = OutputSpec::Kind::Stack;
            gathered[j] = torch::stack(parts);
            break;
          case ScalarGather::Mean:
          case ScalarGather::Sum: {
            spec.kind = OutputSpec::Kind::Weighted;
            const bool mean = options_.scalar_outputs() == ScalarGather::Mean;
            torch::Tensor total;
            for (size_t i = 0; i < n; ++i) {
              spec.weights.push_back(mean ? shares[i] : 1.0);
              auto term = mean ? parts[i] * shares[i] : parts[i];
              total = total.defined() ? total + term : term;
            }
            gathered[j] = total;
            break;
          }
        }
      } else {
        spec.dim = c10::maybe_wrap_dim(options_.dim(), parts[0].dim());
        for (const auto& p : parts) {
          spec.sizes.push_back(p.size(spec.dim));
        }
        gathered[j] = n == 1 ? parts[0] : torch::cat(parts, spec.dim);
      }
      // With one replica running, the gathered tensor can be that replica's own
      // output; giving it ParallelBackward's history would make the replica's
      // graph loop back into the node. detach() keeps storage and version.
      for (const auto& p : parts) {
        if (gathered[j].is_same(p)) {
          gathered[j] = gathered[j].detach();
          break;
        }
      }
    }
    if (needs_grad && is_differentiable(gathered[j])) {
      differentiable.push_back(j);
      specs.push_back(std::move(spec));
    }
  }

  if (options_.buffers() == BufferSync::Average && source_->is_training()) {
    average_buffers(plan);
  }
  if (differentiable.empty()) {
    return gathered;
  }

  auto node = make_node<ParallelBackward>();
  node->pool_ = pool_;
  node->devices_ = options_.devices();
  node->specs_ = std::move(specs);
  std::vector<size_t> grad_params;
  variable_list edges_of;
  for (size_t p = 0; p < source_params_.size(); ++p) {
    if (source_params_[p].requires_grad()) {
      grad_params.push_back(p);
      edges_of.push_back(source_params_[p]);
      node->params_.push_back(source_params_[p]);
    }
  }
  for (const auto& source : inputs.sources) {
    InputMeta meta;
    meta.split = source.split;
    meta.dim = source.dim;
    meta.options = source.tensor.options();
    meta.shape = source.tensor.sizes().vec();
    for (size_t r : plan.used) {
      meta.sizes.push_back(plan.sizes[r]);
    }
    node->inputs_.push_back(std::move(meta));
    edges_of.push_back(source.tensor);
  }
  for (size_t i = 0; i < n; ++i) {
    const size_t r = plan.used[i];
    ReplicaGraph graph;
    graph.replica = r;
    graph.device = options_.devices()[r];
    for (size_t j : differentiable) {
      const auto& t = flat[i][j];
      graph.outputs.push_back(t.requires_grad() ? t : torch::Tensor());
    }
    for (size_t p : grad_params) {
      graph.params.push_back(params_[r][p]);
    }
    graph.leaves = std::move(inputs.leaves[r]);
    TORCH_INTERNAL_ASSERT(graph.leaves.size() == inputs.sources.size());
    node->graphs_.push_back(std::move(graph));
  }
  node->set_next_edges(torch::autograd::collect_next_edges(edges_of));
  for (size_t j : differentiable) {
    torch::autograd::set_history(gathered[j], node);
  }
  return gathered;
}

void DataParallelCore::average_buffers(const Plan& plan) {
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < source_buffers_.size(); ++b) {
    auto& target = source_buffers_[b];
    if (!at::isFloatingType(target.scalar_type())) {
      continue; // counters such as num_batches_tracked move in step on every replica
    }
    torch::Tensor total;
    for (size_t r : plan.used) {
      auto term = buffers_[r][b].to(target.device()) * (static_cast<double>(plan.sizes[r]) / plan.batch);
      total = total.defined() ? total + term : term;
    }
    // Through .data(): BatchNorm saves its running stats for backward without
    // reading them in training mode, and a version bump here would make that
    // backward fail.
    target.data().copy_(total);
  }
}

void DataParallelCore::run_on_all(const std::function<void(size_t)>& fn) {
  if (!pool_) {
    fn(0);
    return;
  }
  std::vector<size_t> all(size());
  for (size_t r = 0; r < all.size(); ++r) {
    all[r] = r;
  }
  run_replicas(*pool_, all, options_.devices(), "map_replicas", fn);
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
