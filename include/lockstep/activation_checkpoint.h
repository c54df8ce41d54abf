#pragma once

/// \file
/// Activation checkpointing, as Python's torch.utils.checkpoint: a segment
/// of forward that keeps none of its activations, and runs again in
/// backward to make them (Note [Activation checkpointing] in
/// src/activation_checkpoint.cpp).

#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

/// Returns fn(inputs), keeping for backward only `inputs`, the random
/// generators' states and the autocast state, not the activations inside fn.
/// Backward runs fn again on the same inputs, with the CPU's generator (and
/// the generators of the inputs' GPUs) as forward left them and under the
/// same autocast, so dropout draws the same numbers: the gradients are
/// bitwise those without checkpointing (but see below). The parameters fn reads (a module's,
/// captured by the lambda) get their gradients through the same backward
/// as the rest of the model, so DistributedDataParallel,
/// FullyShardedDataParallel and DataParallel reduce them as usual.
///
/// fn is kept, and called again in backward, after the caller's frame is
/// gone: it must capture by value what it reads (a module holder, `this`),
/// never a reference to a local. It must compute the same thing when run
/// again: the same operations on
/// the same tensors, with no side effects beyond BatchNorm-like buffer
/// updates (which then happen twice, as in PyTorch). fn may read tensors it
/// is not given, parameters or results computed before it: their gradients
/// reach them too. Without autograd (NoGradGuard) fn simply runs.
///
/// Errors in backward: an input changed in place once given to the segment,
/// by fn or after it (the recomputation would read other values; change a
/// clone instead), and a
/// backward with create_graph=true (double backward), whose second-order
/// terms the recomputation cannot carry. Under autocast each run of fn casts
/// the weights for itself (autocast's cache is off inside it), so a layer
/// used in several segments has its gradients summed in fp32 where a plain
/// run sums them in the cast dtype: close, not the same bits. DataParallel's
/// CPU replicas (and a GPU listed twice) draw from one generator on several
/// threads at once, so there a segment that draws random numbers (dropout)
/// does not draw the same ones again in backward: keep such segments free
/// of randomness, or checkpoint under DistributedDataParallel instead.
/// As in PyTorch, a parameter fn reads must keep its values until backward
/// has run: one changed in place in between (an optimizer step between
/// forward and backward) gets the gradient at its new values, where a plain
/// backward would usually refuse.
std::vector<torch::Tensor> checkpoint(
    const std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>& fn,
    const std::vector<torch::Tensor>& inputs);

namespace detail {
template <size_t... I>
auto tensors_as_tuple(const std::vector<torch::Tensor>& in, std::index_sequence<I...>) {
  return std::tuple<const std::decay_t<decltype(in[I])>&...>(in[I]...);
}
} // namespace detail

/// checkpoint for a segment of tensors in, one tensor out (fn is copied):
/// `x = lockstep::checkpoint([block = block](const torch::Tensor& h) { return block(h); }, x);`
template <typename F, typename... Tensors>
torch::Tensor checkpoint(F&& fn, const torch::Tensor& first, const Tensors&... rest) {
  static_assert((std::is_convertible_v<const Tensors&, const torch::Tensor&> && ...),
                "lockstep::checkpoint(fn, inputs...): every input must be a torch::Tensor");
  static_assert(std::is_invocable_v<std::decay_t<F>&, const torch::Tensor&, const Tensors&...>,
                "lockstep::checkpoint(fn, inputs...): fn must take the inputs as tensors, one parameter each; for "
                "a fn of std::vector<torch::Tensor>, pass std::vector<torch::Tensor>{...} as the inputs");
  auto outputs = checkpoint(
      [fn = std::forward<F>(fn)](const std::vector<torch::Tensor>& in) mutable {
        return std::apply([&fn](const auto&... t) { return std::vector<torch::Tensor>{fn(t...)}; },
                          detail::tensors_as_tuple(in, std::index_sequence_for<torch::Tensor, Tensors...>{}));
      },
      std::vector<torch::Tensor>{first, rest...});
  return outputs.at(0);
}

/// A module that runs its forward as a checkpoint segment when asked: the
/// base a FullyShardedDataParallel unit needs under
/// ShardingOptions().activation_checkpointing(true), beside
/// torch::nn::Module. LibTorch modules have no forward hooks, so the
/// wrapper cannot wrap a unit's call from outside: the unit's own forward
/// routes its body through checkpointed_call, which checkpoints when the
/// switch is on and calls directly when it is off (the default).
///
///   struct BlockImpl : torch::nn::Cloneable<BlockImpl>, lockstep::Checkpointable {
///     torch::Tensor forward(const torch::Tensor& x) {
///       return checkpointed_call([this](const torch::Tensor& h) { return body(h); }, x);
///     }
///     torch::Tensor body(const torch::Tensor& h);
///   };
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  /// Turns checkpointing of this module's forward on or off.
  void set_activation_checkpointing(bool on) {
    activation_checkpointing_ = on;
  }
  /// Whether this module's forward runs as a checkpoint segment.
  bool activation_checkpointing() const {
    return activation_checkpointing_;
  }

 protected:
  /// fn(inputs...), through lockstep::checkpoint when the switch is on. fn
  /// is kept for backward, so it captures `this`, not a local.
  template <typename F, typename... Tensors>
  torch::Tensor checkpointed_call(F&& fn, const torch::Tensor& first, const Tensors&... rest) {
    if (activation_checkpointing_) {
      return checkpoint(std::forward<F>(fn), first, rest...);
    }
    return fn(first, rest...);
  }

 private:
  bool activation_checkpointing_ = false;
};

} // namespace lockstep
