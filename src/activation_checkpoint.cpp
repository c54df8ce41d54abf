#include <lockstep/activation_checkpoint.h>

#include "util/autocast_state.h"
#include "util/torch_compat.h"

#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace lockstep {
namespace detail {
namespace {

// Note [Activation checkpointing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// As torch.utils.checkpoint, the segment's forward keeps its inputs, not its
// activations, and backward runs it again. Python's default (non-reentrant)
// version finds what the segment saved through saved-tensor hooks, which
// LibTorch does not have from C++; its reentrant version runs a backward
// of its own inside the outer one, and so accumulates the parameters'
// gradients there, where DistributedDataParallel's and
// FullyShardedDataParallel's end-of-backward callbacks would attach to the
// inner backward and run before the rest of the model's gradients came.
// Here the segment's gradients go through the outer backward instead. The
// first run of fn, with autograd on, shows which edges its graph leaves by:
// the inputs' (detached copies), the parameters' gradient accumulators, and
// any node fn did not make (a tensor computed before it, a DataParallel
// replica's parameter). One
// node, CheckpointBackward, then stands for the whole segment: its next
// edges are those, and fn's graph is dropped with its activations. In
// backward the node runs fn again on the saved inputs, computes the
// gradients that reach those same edges (captured at nodes that stand for
// them, Note [Where the recomputation stops]), and hands them to the outer
// backward, which accumulates them and runs every hook as it would without
// checkpointing.
// fn runs again with the generators set to the states they had before its
// first run (then restored), and under the autocast state it ran in, so it
// computes the same values: the gradients are the same bits.
//
// Both runs keep autocast's cast cache off. A cast of a weight cached
// before the segment (the same layer in an earlier segment or outside any)
// is a node fn did not make, so the first run would take it for an exit
// and never reach the weight's accumulator; the recomputation, with the
// cache cleared, makes a cast of its own, and the weight's gradient from
// the segment was lost. Each run casting for itself keeps both graphs
// fn's own. An input changed in place once given to the segment (by fn,
// or after it) is an error in backward (its version counter moved), as
// PyTorch's checkpoint's inputs, saved before fn runs, are: the
// recomputation would read other values. A
// backward that creates a graph (double backward) is refused: the
// recomputation's gradients would end at its own detached inputs.

// Note [Recomputations on several threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The generators are the process's, and DataParallel's CPU replicas run
// their backwards, and so their recomputations, on several threads at
// once. Each recomputation sets the generators to its segment's states;
// were each to put back what it found, two that overlap would leave them
// at a state the first set, older than where the caller left them, and the
// next step's dropout would draw numbers already drawn. So the state the
// caller left is saved by the first recomputation to begin and put back by
// the last to end. (Segments that draw random numbers while others
// recompute on other threads do not draw their forward's numbers again:
// the header says to keep such segments free of randomness.)

struct Segment {
  std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)> fn;
  std::vector<torch::Tensor> inputs; // detached, requires_grad as given
  std::vector<size_t> differentiable; // fn's outputs that have a gradient, in order
  std::vector<uint32_t> versions; // the inputs' version counters before fn
  std::vector<std::pair<at::Generator, torch::Tensor>> generators; // and their states before fn
  AutocastState autocast; // the caller's, with the cast cache off
};

// Autocast's cast cache off on this thread for the lifetime of this object.
class CastCacheOff {
 public:
  CastCacheOff() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~CastCacheOff() {
    at::autocast::set_autocast_cache_enabled(previous_);
  }
  CastCacheOff(const CastCacheOff&) = delete;
  CastCacheOff& operator=(const CastCacheOff&) = delete;

 private:
  bool previous_;
};

// The states of `segment`'s generators for the lifetime of this object
// (Note [Recomputations on several threads]).
class GeneratorsAsBefore {
 public:
  explicit GeneratorsAsBefore(const Segment& segment) {
    std::lock_guard<std::mutex> lock(mutex());
    try {
      for (const auto& [generator, state] : segment.generators) {
        auto g = generator;
        std::lock_guard<std::mutex> generator_lock(g.mutex());
        auto& entered = active()[g.unsafeGetGeneratorImpl()];
        if (entered.count == 0) {
          entered.state_before = g.get_state();
        }
        ++entered.count;
        held_.push_back(g);
        g.set_state(state);
      }
    } catch (...) {
      release(); // what was entered before the throw
      throw;
    }
  }
  ~GeneratorsAsBefore() {
    std::lock_guard<std::mutex> lock(mutex());
    release();
  }
  GeneratorsAsBefore(const GeneratorsAsBefore&) = delete;
  GeneratorsAsBefore& operator=(const GeneratorsAsBefore&) = delete;

 private:
  // Leaves each generator entered; the last to leave one puts back its
  // state. Under mutex().
  void release() {
    for (auto& generator : held_) {
      auto it = active().find(generator.unsafeGetGeneratorImpl());
      TORCH_INTERNAL_ASSERT(it != active().end() && it->second.count > 0);
      if (--it->second.count == 0) {
        std::lock_guard<std::mutex> generator_lock(generator.mutex());
        generator.set_state(it->second.state_before);
        active().erase(it);
      }
    }
    held_.clear();
  }
  struct Entered {
    size_t count = 0;            // recomputations under way with this generator
    torch::Tensor state_before;  // its state when the first of them began
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<const c10::GeneratorImpl*, Entered>& active() {
    static std::unordered_map<const c10::GeneratorImpl*, Entered> entered;
    return entered;
  }
  std::vector<at::Generator> held_;
};

// The graph's end for one edge by which the segment's recomputed graph
// leaves it: the gradient is captured here, and nothing runs past it
// (Note [Where the recomputation stops]). It takes the metadata of the
// input it stands for, so the engine checks and reduces the gradient
// reaching it as it would the original's.
class SegmentExit : public torch::autograd::Node {
 public:
  explicit SegmentExit(const torch::autograd::InputMetadata& metadata)
      : Node(/*sequence_nr=*/UINT64_MAX, /*next_edges=*/{}) {
    input_metadata_.push_back(metadata);
  }
  std::string name() const override {
    return "lockstep::SegmentExit";
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    return {};
  }
};

// The sequence numbers this thread gave the nodes fn made: [first, last).
struct MadeByFn {
  uint64_t thread, first, last;
  bool operator()(const torch::autograd::Node& node) const {
    return node.thread_id() == thread && node.sequence_nr() >= first && node.sequence_nr() < last;
  }
};

// Walks fn's graph from `roots` and calls on_exit(edge) on each edge by which
// it leaves the segment: to a gradient accumulator other than the inputs'
// (`own`), or to a node fn did not make (a node's sequence number counts
// per thread, so a node of another thread, a DataParallel replica's
// parameter, is never taken for one of fn's). Where on_exit returns an edge,
// it replaces the one it was given (in `roots` too).
void walk_segment(torch::autograd::edge_list& roots, const std::unordered_set<const torch::autograd::Node*>& own,
                  MadeByFn made,
                  const std::function<std::optional<torch::autograd::Edge>(const torch::autograd::Edge&)>& on_exit) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  // An edge that leaves is handed to on_exit, and replaced by its answer through `replace`.
  auto visit = [&](const torch::autograd::Edge& edge, const std::function<void(torch::autograd::Edge)>& replace) {
    auto* node = edge.function.get();
    if (node == nullptr || own.count(node) != 0) {
      return;
    }
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr || !made(*node)) {
      if (auto replacement = on_exit(edge)) {
        replace(std::move(*replacement));
      }
    } else if (seen.insert(node).second) {
      stack.push_back(node);
    }
  };
  for (auto& root : roots) {
    visit(root, [&root](torch::autograd::Edge e) { root = std::move(e); });
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (size_t i = 0; i < node->num_outputs(); ++i) {
      // Not set_next_edge, which refuses a node that has a parent: a
      // SegmentExit's topological number, 0, keeps the node's above it.
      visit(node->next_edge(i), [node, i](torch::autograd::Edge e) { node->next_edges()[i] = std::move(e); });
    }
  }
}

// The edges by which fn's graph, from `outputs`, leaves the segment, each
// once, in the order met.
torch::autograd::edge_list edges_out(const std::vector<torch::Tensor>& outputs,
                                     const std::unordered_set<const torch::autograd::Node*>& own, MadeByFn made) {
  torch::autograd::edge_list roots;
  for (const auto& output : outputs) {
    if (output.defined() && output.requires_grad()) {
      roots.push_back(torch::autograd::impl::gradient_edge(output));
    }
  }
  torch::autograd::edge_list out;
  walk_segment(roots, own, made, [&out](const torch::autograd::Edge& edge) -> std::optional<torch::autograd::Edge> {
    const bool met = std::any_of(out.begin(), out.end(), [&edge](const torch::autograd::Edge& e) {
      return e.function == edge.function && e.input_nr == edge.input_nr;
    });
    if (!met) {
      out.push_back(edge);
    }
    return std::nullopt;
  });
  return out;
}

// Note [Where the recomputation stops]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The recomputation's backward must compute the gradients that reach the
// segment's exits and run nothing beyond them: the outer backward runs
// those nodes, once. Capturing at the exits themselves is not enough. The
// engine runs a captured node when another captured node lies beyond it (a
// segment that reads both a weight and weight.t() made before it), which
// would add that path's gradient twice, or free its saved tensors before
// the outer backward reaches it; and PyTorch 2.x runs a captured node's
// tensor hooks (register_hook, retain_grad), which the outer backward runs
// again. So each edge of the recomputed graph that leaves the segment is
// pointed at a SegmentExit of its own, a node with no next edges, and the
// gradients are captured there.
torch::autograd::edge_list stop_at_exits(torch::autograd::edge_list& roots,
                                         const std::unordered_set<const torch::autograd::Node*>& own, MadeByFn made,
                                         const torch::autograd::edge_list& exits) {
  std::vector<NodePtr> stops(exits.size());
  walk_segment(roots, own, made, [&](const torch::autograd::Edge& edge) -> std::optional<torch::autograd::Edge> {
    for (size_t k = 0; k < exits.size(); ++k) {
      if (exits[k].function == edge.function && exits[k].input_nr == edge.input_nr) {
        if (!stops[k]) {
          stops[k] = make_node<SegmentExit>(edge.function->input_metadata(edge.input_nr));
        }
        return torch::autograd::Edge(stops[k], 0);
      }
    }
    TORCH_CHECK(false, "lockstep::checkpoint: running the segment again in backward, its graph reached ",
                edge.function->name(), ", which its first run did not: fn must compute the same thing both times.");
  });
  torch::autograd::edge_list capture;
  for (size_t k = 0; k < exits.size(); ++k) {
    // An exit the recomputation does not reach gets no gradient.
    const auto& out = exits[k];
    capture.emplace_back(stops[k] ? stops[k] : NodePtr(make_node<SegmentExit>(out.function->input_metadata(out.input_nr))),
                         0);
  }
  return capture;
}

class CheckpointBackward : public torch::autograd::Node {
 public:
  CheckpointBackward(std::shared_ptr<Segment> segment, size_t leaving_inputs)
      : segment_(std::move(segment)), leaving_inputs_(leaving_inputs) {}
  std::string name() const override {
    return "lockstep::CheckpointBackward";
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  void release_variables() override {
    segment_.reset();
  }

 private:
  std::shared_ptr<Segment> segment_;
  size_t leaving_inputs_; // the first next edges: the inputs that require a gradient
};

torch::autograd::variable_list CheckpointBackward::apply(torch::autograd::variable_list&& grads) {
  TORCH_CHECK(segment_, "lockstep::checkpoint: the segment's backward ran a second time, after its inputs were "
              "freed. Pass retain_graph=true to the first backward to run it twice.");
  TORCH_CHECK(!torch::GradMode::is_enabled(), "lockstep::checkpoint: a backward with create_graph=true (double "
              "backward, a gradient penalty) reached a checkpointed segment, whose recomputed gradients would not "
              "carry the second-order terms to the segment's inputs. Run that part of the model without "
              "lockstep::checkpoint.");
  for (size_t i = 0; i < segment_->inputs.size(); ++i) {
    const auto now = segment_->inputs[i]._version();
    TORCH_CHECK(now == segment_->versions[i], "lockstep::checkpoint: input ", i, " of the segment was changed in "
                "place once given to it, by the segment or after it (its version went from ", segment_->versions[i],
                " to ", now, "), so running the segment again in backward would compute from other values. Change a "
                "copy (x = x.clone(), then change x), or pass the segment a clone of it.");
  }
  torch::autograd::variable_list outputs;
  torch::autograd::edge_list capture;
  const uint64_t first = at::sequence_number::peek();
  {
    GeneratorsAsBefore generators(*segment_);
    ReplicaAutocast autocast(segment_->autocast);
    torch::AutoGradMode grad_mode(true);
    std::vector<torch::Tensor> inputs;
    for (const auto& input : segment_->inputs) {
      inputs.push_back(input.detach().requires_grad_(input.requires_grad()));
      if (input.requires_grad()) {
        capture.push_back(torch::autograd::impl::gradient_edge(inputs.back()));
      }
    }
    TORCH_INTERNAL_ASSERT(capture.size() == leaving_inputs_);
    outputs = segment_->fn(inputs);
  }
  const MadeByFn made{at::RecordFunction::currentThreadId(), first, at::sequence_number::peek()};
  torch::autograd::edge_list roots;
  torch::autograd::variable_list root_grads;
  for (size_t k = 0; k < segment_->differentiable.size(); ++k) {
    const auto& output = outputs.at(segment_->differentiable[k]);
    TORCH_CHECK(output.requires_grad(), "lockstep::checkpoint: output ", segment_->differentiable[k], " of the segment "
                "had a gradient in forward and has none when backward runs it again: fn must compute the same thing "
                "both times.");
    if (grads[k].defined()) {
      roots.push_back(torch::autograd::impl::gradient_edge(output));
      root_grads.push_back(grads[k]);
    }
  }
  if (roots.empty()) {
    return torch::autograd::variable_list(num_outputs());
  }
  std::unordered_set<const torch::autograd::Node*> own;
  for (const auto& edge : capture) {
    own.insert(edge.function.get());
  }
  const torch::autograd::edge_list exits(next_edges().begin() + static_cast<std::ptrdiff_t>(leaving_inputs_),
                                         next_edges().end());
  const auto stops = stop_at_exits(roots, own, made, exits);
  capture.insert(capture.end(), stops.begin(), stops.end());
  return torch::autograd::Engine::get_default_engine().execute(roots, root_grads, /*keep_graph=*/false,
                                                               /*create_graph=*/false, /*accumulate_grad=*/false,
                                                               capture);
}

// The default generators of the CPU and of each device among `inputs`,
// with their states now.
std::vector<std::pair<at::Generator, torch::Tensor>> generator_states(const std::vector<torch::Tensor>& inputs) {
  std::vector<torch::Device> devices{torch::kCPU};
  for (const auto& input : inputs) {
    const auto device = input.device();
    if (!device.is_cpu() && std::find(devices.begin(), devices.end(), device) == devices.end()) {
      devices.push_back(device);
    }
  }
  std::vector<std::pair<at::Generator, torch::Tensor>> states;
  for (const auto& device : devices) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.emplace_back(generator, generator.get_state());
  }
  return states;
}

} // namespace
} // namespace detail

std::vector<torch::Tensor> checkpoint(
    const std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>& fn,
    const std::vector<torch::Tensor>& inputs) {
  TORCH_CHECK(fn, "lockstep::checkpoint: fn is empty.");
  if (!torch::GradMode::is_enabled()) {
    return fn(inputs);
  }
  auto segment = std::make_shared<detail::Segment>();
  segment->fn = fn;
  segment->autocast = detail::AutocastState::current();
  segment->autocast.cache_enabled = false;
  // The gradient accumulators of the detached inputs, held while fn runs:
  // autograd holds one weakly, and one freed could give its address to a
  // parameter's, which would then look like an input's.
  torch::autograd::edge_list own_edges;
  std::unordered_set<const torch::autograd::Node*> own;
  torch::autograd::edge_list leaving; // the inputs' own edges first
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "lockstep::checkpoint: input ", i, " is an undefined tensor.");
    segment->inputs.push_back(inputs[i].detach().requires_grad_(inputs[i].requires_grad()));
    segment->versions.push_back(inputs[i]._version());
    if (inputs[i].requires_grad()) {
      own_edges.push_back(torch::autograd::impl::gradient_edge(segment->inputs.back()));
      own.insert(own_edges.back().function.get());
      leaving.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    }
  }
  segment->generators = detail::generator_states(inputs);
  const size_t leaving_inputs = leaving.size();
  std::vector<torch::Tensor> outputs;
  {
    const uint64_t first = at::sequence_number::peek();
    std::vector<torch::Tensor> graph;
    {
      detail::CastCacheOff no_cache;
      graph = fn(segment->inputs);
    }
    const detail::MadeByFn made{at::RecordFunction::currentThreadId(), first, at::sequence_number::peek()};
    auto out = detail::edges_out(graph, own, made);
    leaving.insert(leaving.end(), out.begin(), out.end());
    for (size_t k = 0; k < graph.size(); ++k) {
      if (graph[k].defined() && graph[k].requires_grad()) {
        segment->differentiable.push_back(k);
      }
      outputs.push_back(graph[k].defined() ? graph[k].detach() : graph[k]);
    }
  } // fn's graph, and with it its activations, goes here
  if (segment->differentiable.empty()) {
    return outputs;
  }
  auto node = detail::make_node<detail::CheckpointBackward>(segment, leaving_inputs);
  node->set_next_edges(std::move(leaving));
  for (size_t k : segment->differentiable) {
    torch::autograd::set_history(outputs[k], node);
  }
  return outputs;
}

} // namespace lockstep
