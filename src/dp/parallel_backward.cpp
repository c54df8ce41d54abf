#include "dp/parallel_backward.h"
#include "util/torch_compat.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace lockstep {
namespace detail {

using torch::autograd::variable_list;

ReplicaToModule::ReplicaToModule(const torch::Tensor& replica, const torch::Tensor& module)
    : sizes_(replica.sizes().vec()),
      dtype_(replica.dtype()),
      replica_device_(replica.device()),
      module_device_(module.device()) {
  add_input_metadata(replica);
  set_next_edges({torch::autograd::impl::gradient_edge(module)});
}

variable_list ReplicaToModule::apply(variable_list&& grads) {
  TORCH_INTERNAL_ASSERT(grads.size() == 1);
  if (!grads[0].defined()) {
    return {torch::Tensor()};
  }
  return {grads[0].to(module_device_)}; // differentiable: double backward goes through it
}

bool ReplicaToModule::links(const torch::Tensor& replica, const torch::Tensor& module) const {
  return replica.sizes() == c10::IntArrayRef(sizes_) && replica.dtype() == dtype_ && replica.device() == replica_device_ &&
      module.device() == module_device_ && next_edge(0) == torch::autograd::impl::gradient_edge(module);
}

void link_to_module(torch::Tensor& replica, const torch::Tensor& module) {
  if (replica.is_same(module) || (!module.requires_grad() && !replica.requires_grad())) {
    return; // the module itself (it runs alone), or a plain leaf already
  }
  if (module.requires_grad()) {
    auto* current = dynamic_cast<ReplicaToModule*>(replica.grad_fn().get());
    if (current != nullptr && current->links(replica, module)) {
      return;
    }
  }
  torch::autograd::impl::set_gradient_edge(replica, {}); // a leaf again
  if (replica.requires_grad()) {
    replica.requires_grad_(false);
  }
  if (module.requires_grad()) {
    torch::autograd::impl::set_gradient_edge(replica, torch::autograd::Edge(make_node<ReplicaToModule>(replica, module), 0));
  }
}

void ParallelBackward::release_variables() {
  plan_.replicas.clear();
  released_ = true;
}

// Note [Shared parameters in replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor the module holds under several names (a block used twice, tied
// weights) may or may not be one tensor in a replica: a clone shares what
// reset() shares, but Sequential, ModuleList and ModuleDict clone each
// entry on its own, so Sequential(b, tanh, b) becomes two blocks there.
// autograd::grad gives a tensor asked for under two names its whole
// gradient at each, and two tensors each their own use's. So each replica
// keeps the first entry of each of its own tensors (drop_repeated_params),
// and the module's tensor takes the sum over all its names' entries.
namespace {

void drop_repeated_params(const ReplicaGraph& graph, variable_list& result) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t p = 0; p < graph.params.size() && p < result.size(); ++p) {
    if (!seen.insert(graph.params[p].unsafeGetTensorImpl()).second) {
      result[p] = torch::Tensor();
    }
  }
}

// Which of `params`' .grad the current backward adds to: every one for a
// plain backward(), those of backward(inputs) for it, none for
// autograd::grad, after which a zero .grad must still be there. Read on
// the engine's thread: the graph task is that thread's.
std::vector<char> accumulated(const std::vector<torch::Tensor>& params) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  std::vector<char> accumulates(params.size(), 1);
  for (size_t p = 0; exec_info != nullptr && !exec_info->empty() && p < params.size(); ++p) {
    auto it = exec_info->find(torch::autograd::impl::gradient_edge(params[p]).function.get());
    accumulates[p] = it != exec_info->end() && it->second.needed_;
  }
  return accumulates;
}

} // namespace


variable_list ParallelBackward::apply(variable_list&& grads) {
  TORCH_CHECK(
      !released_,
      "lockstep::DataParallel: backward through the same DataParallel output a second time. "
      "Pass retain_graph=true to the first backward() if you need to go through it again.");
  TORCH_INTERNAL_ASSERT(grads.size() == plan_.outputs.size());
  const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
  // The engine enables grad mode for create_graph: each replica's backward
  // then records its own graph, which reaches the module's parameters and the
  // caller's inputs through the replicas' non-leaf tensors (Note [Replica
  // parameters] in src/dp/data_parallel.cpp), so double backward works.
  const bool create_graph = torch::GradMode::is_enabled();

  std::vector<variable_list> results(plan_.replicas.size());
  auto backward_one = [&](size_t g) {
    ReplicaGraph& graph = plan_.replicas[g];
    variable_list outputs, grad_outputs;
    for (size_t j = 0; j < plan_.outputs.size(); ++j) {
      if (!grads[j].defined() || !graph.outputs[j].defined()) {
        continue;
      }
      outputs.push_back(graph.outputs[j]);
      grad_outputs.push_back(piece(grads[j], plan_.outputs[j], g).to(graph.device));
    }
    variable_list inputs = graph.params;
    inputs.insert(inputs.end(), graph.leaves.begin(), graph.leaves.end());
    if (outputs.empty() || inputs.empty()) {
      return;
    }
    results[g] = torch::autograd::grad(outputs, inputs, grad_outputs, keep_graph, create_graph, /*allow_unused=*/true);
    drop_repeated_params(graph, results[g]);
  };

  // CPU replicas run their backward on their own workers, in parallel. The
  // engine runs a device's work on that device's engine thread, which is
  // the thread we are on when the output is on a GPU; so GPU replicas run
  // here, as reentrant backward, and cannot wait on themselves.
  std::vector<size_t> on_workers, worker_graph(plan_.devices.size(), 0);
  for (size_t g = 0; g < plan_.replicas.size(); ++g) {
    if (plan_.replicas[g].device.is_cpu()) {
      on_workers.push_back(plan_.replicas[g].replica);
      worker_graph[plan_.replicas[g].replica] = g;
    } else {
      backward_one(g);
    }
  }
  if (!on_workers.empty()) {
    map_replicas(*plan_.pool, on_workers, plan_.devices, "backward", [&](size_t r) { backward_one(worker_graph[r]); });
  }
  if (!keep_graph) {
    release_variables();
  }
  return combine(results, on_workers);
}

// Replica g's share of a gathered output's gradient.
torch::Tensor ParallelBackward::piece(const torch::Tensor& grad, const OutputSpec& spec, size_t g) const {
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

std::vector<size_t> assign_sums(const std::vector<int64_t>& numels, size_t workers) {
  TORCH_INTERNAL_ASSERT(workers > 0);
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(workers, 0);
  std::vector<size_t> owner(numels.size(), 0);
  for (size_t p : order) {
    const auto least = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[p] = least;
    load[least] += numels[p];
  }
  return owner;
}

namespace {

// Whether `grad` is its own memory, held by the parameter alone.
bool owned_alone(const torch::Tensor& grad) {
  return !grad.is_view() && grad.use_count() == 1 && grad.storage().use_count() == 1;
}

} // namespace

// Sums parameter gradients over replicas and puts input gradients back
// together, in the order of this node's next edges.
variable_list ParallelBackward::combine(std::vector<variable_list>& results, const std::vector<size_t>& workers) const {
  variable_list out(plan_.params.size() + plan_.inputs.size());
  sum_param_gradients(results, workers, out);
  for (size_t s = 0; s < plan_.inputs.size(); ++s) {
    out[plan_.params.size() + s] = input_gradient(results, s);
  }
  return out;
}

// The sums go to the engine, so that tensor hooks on the parameters see every
// gradient and AccumulateGrad runs as without the wrapper. The engine adds
// into a defined .grad on the calling thread, alone (it gave its cores to the
// replicas): a pass over every gradient that cost 15% of an MLP step. So when
// .grad is on the CPU, holds only zeros (zero_grad() without set_to_none)
// and this backward adds to it, the workers undefine it and the engine takes
// the sum as the new .grad: the same values, no add (on a GPU, reading for
// zeros would wait for the device once per parameter). Only where nothing else holds that
// .grad or its memory (owned_alone): a .grad that is a view of a flat
// buffer, or that the caller keeps, is added into in place, as autograd's
// AccumulateGrad does. The sums, and the reading for zeros, are shared out over the CPU
// workers by size (assign_sums): the calling thread has yielded its cores to
// them.
void ParallelBackward::sum_param_gradients(
    std::vector<variable_list>& results,
    const std::vector<size_t>& workers,
    variable_list& out) const {
  const size_t n_params = plan_.params.size();
  // Note [Shared parameters in replicas]: a tensor of the module under
  // several names takes the sum over its names' entries, passed on by its
  // first name alone (the others' edges lead to the same tensor, which
  // would take it twice); only the first touches .grad, whatever worker
  // each entry goes to.
  std::vector<std::vector<size_t>> names(n_params); // at each tensor's first name: all its names
  std::unordered_map<const c10::TensorImpl*, size_t> first_name;
  for (size_t p = 0; p < n_params; ++p) {
    names[first_name.emplace(plan_.params[p].unsafeGetTensorImpl(), p).first->second].push_back(p);
  }
  const auto accumulates = accumulated(plan_.params);
  auto sum_param = [&](size_t p) {
    if (names[p].empty()) {
      return;
    }
    for (auto& result : results) {
      for (size_t q : names[p]) {
        if (result.empty() || !result[q].defined()) {
          continue;
        }
        auto g = result[q].to(plan_.params[p].device());
        out[p] = out[p].defined() ? out[p].add(g) : g;
      }
    }
    auto& grad = plan_.params[p].mutable_grad();
    if (accumulates[p] && out[p].defined() && grad.defined() && grad.layout() == torch::kStrided &&
        grad.is_cpu() && !grad.requires_grad() && owned_alone(grad) && !grad.any().item<bool>()) {
      grad.reset();
    }
  };
  if (workers.size() <= 1) {
    for (size_t p = 0; p < n_params; ++p) {
      sum_param(p);
    }
    return;
  }
  std::vector<int64_t> numels;
  for (size_t p = 0; p < n_params; ++p) {
    numels.push_back(names[p].empty() ? 0 : plan_.params[p].numel() * static_cast<int64_t>(names[p].size()));
  }
  const auto owner = assign_sums(numels, workers.size());
  std::vector<size_t> slot(plan_.devices.size(), 0);
  for (size_t i = 0; i < workers.size(); ++i) {
    slot[workers[i]] = i;
  }
  map_replicas(*plan_.pool, workers, plan_.devices, "backward", [&](size_t r) {
    for (size_t p = 0; p < n_params; ++p) {
      if (owner[p] == slot[r]) {
        sum_param(p);
      }
    }
  });
}

// The gradient of the caller's input s: the sum over replicas for an input
// every replica received whole, the replicas' pieces put back together (zeros
// for a piece without one) for a split input; undefined if no replica has one.
torch::Tensor ParallelBackward::input_gradient(const std::vector<variable_list>& results, size_t s) const {
  const size_t index = plan_.params.size() + s;
  const InputMeta& meta = plan_.inputs[s];
  const auto device = meta.options.device();
  if (!meta.split) {
    torch::Tensor sum;
    for (const auto& result : results) {
      if (!result.empty() && result[index].defined()) {
        auto g = result[index].to(device);
        sum = sum.defined() ? sum.add(g) : g;
      }
    }
    return sum;
  }
  std::vector<torch::Tensor> pieces;
  bool any = false;
  for (size_t g = 0; g < results.size(); ++g) {
    if (!results[g].empty() && results[g][index].defined()) {
      pieces.push_back(results[g][index].to(device));
      any = true;
    } else {
      auto shape = meta.shape;
      shape[meta.dim] = meta.sizes[g];
      pieces.push_back(torch::zeros(shape, meta.options));
    }
  }
  return any ? torch::cat(pieces, meta.dim) : torch::Tensor();
}

} // namespace detail
} // namespace lockstep
