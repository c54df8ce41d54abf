// FullyShardedDataParallel's summon_full_params: every unit gathered, the
// module's parameters its views, then edits written back into the shards;
// and the module between steps: what a forward without its backward, or
// one that throws, leaves gathered, and the checks that nothing was edited
// at rest.

#include "fsdp/state.h"

#include <cstdio>

namespace lockstep {
namespace detail {

// Note [Replaced parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inside summon_full_params the module's parameters view the gathered
// buffer, and the writeback copies from that buffer. torch::load, and
// anything else that calls set_ or set_data on a parameter, gives it storage
// of its own instead of writing into the buffer: the loaded values would be
// lost at the writeback, and under NoShard, whose parameters view the shard
// itself, the module would go on computing with tensors the optimizer never
// steps. So when the guard ends, each parameter that no longer views its
// buffer is copied into it (with writeback; a parameter whose shape changed
// is an error naming it) and made to view it again.
void ShardedCore::State::adopt_replaced_params(bool writeback) {
  torch::NoGradGuard no_grad;
  for (auto& flat : flats) {
    for (size_t j = 0; j < flat.params.size(); ++j) {
      auto& param = flat.params[j];
      // flat.views view the gathered buffer (NoShard's: the shard itself).
      const auto shape = flat.views[j].sizes();
      auto view = flat.summoned.defined() ? flat.summoned.narrow(0, flat.offsets[j], flat.views[j].numel()).view(shape)
                                          : flat.views[j];
      if (param.is_alias_of(view)) {
        continue;
      }
      if (writeback) {
        TORCH_CHECK(param.sizes() == shape, where(), "parameter '", flat.names[j], "' was given a tensor of shape ",
                    param.sizes(), " inside summon_full_params(), but the sharded model's is ", shape,
                    ". Load a checkpoint of this model (torch::load replaces each parameter by the one in the file).");
        view.copy_(param);
      }
      param.set_data(view);
      restore_grad_accumulator(param, flat.accumulators[j]); // set_data forgets it when the dtype changed
    }
  }
}

// Note [A forward without its backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A forward whose backward has not come (a prediction logged, a target under
// NoGradGuard, a microbatch dropped) leaves units gathered: FullShard's
// root and last bucket, every unit of ShardGradOp. An optimizer step or a
// load_sharded may change the shards before the next forward, and a unit
// still gathered would skip its all-gather and compute, and take gradients,
// at the old values. Since nothing tells a step apart from no step (SGD
// writes through .data(), which moves no version counter), such a forward
// gathers every unit again; the buffers stay where they are, so an earlier
// forward's graph, whose backward may still come, reads the same values.
// The price is one more all-gather of what was left gathered, in a pattern
// that already runs a forward more.
void ShardedCore::State::forget_gathered() {
  wait_in_flight();
  for (auto& flat : flats) {
    if (flat.gathered) {
      release(flat, /*empty=*/false);
    }
  }
}

// Note [A forward that throws]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A forward the module ends with an exception (a bad batch the caller
// skips) has gathered units that after_forward never sees. Left marked
// gathered, they would skip the next forward's all-gather, and the next
// summon's, after an optimizer step or a load changed the shards: computing
// at the old values, and a summon's writeback would copy those back over
// the step. So what it gathered is forgotten, as for a forward without its
// backward, and the pass ends, unless an earlier forward's backward is
// still to come: that backward then gathers what it reads. A collective
// that failed meanwhile is left for the next call to report: the module's
// own exception is the one to rethrow.
void ShardedCore::abort_forward() noexcept {
  auto& s = *state_;
  if (!s.sharded() || s.pass != State::Pass::Forward) {
    return;
  }
  try {
    Unwatched unwatched;
    s.forget_gathered();
    if (s.forwarded) {
      s.pass = State::Pass::AfterForward;
      s.order.clear();
    } else {
      s.end_pass();
    }
  } catch (...) {
  }
}

// Note [Edits outside summon_full_params]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Outside forward, backward and summon_full_params, FullShard's and
// ShardGradOp's module parameters are empty tensors, and the next forward
// points them at the gathered buffer again. An in-place change made to one
// there (an init's normal_() or zero_() through module()->apply(), a
// copy_, torch::load's set_) changes nothing and raises nothing in
// LibTorch: the model trains from its old values. So is an optimizer made
// from module()->parameters(), or from the module's own parameters before
// wrapping (DDP's habit): the shards take the gradients. Each in-place
// change moves the parameter's version counter, which our own set_data does
// not, so the next forward or summon_full_params compares the counters with
// those noted when the parameters were emptied and refuses, naming the
// parameter. For the optimizer to show itself, each emptied parameter
// without a gradient gets an empty one to match: LibTorch's optimizers
// skip a parameter without a gradient, and Adam, AdamW, RMSprop and
// Adagrad write into it in place (SGD writes through .data(), which the
// counter does not see, and stays undetected). Those empty gradients are
// dropped when the parameters leave rest, whatever zero_grad() made of
// them, so that autograd never adds to them. NoShard's parameters view its
// shard, so edits there take effect, and are not checked.
// The error is raised once: the parameters leave rest either way.
void ShardedCore::State::check_untouched_at_rest() {
  const std::string* changed = nullptr;
  for (auto& flat : flats) {
    for (size_t j = 0; flat.resting && j < flat.params.size(); ++j) {
      auto& param = flat.params[j];
      if (changed == nullptr && param._version() != flat.rest_versions[j]) {
        changed = &flat.names[j];
      }
      auto& grad = param.mutable_grad();
      if (grad.defined() && grad.numel() == 0) {
        grad = torch::Tensor(); // the empty gradient rest gave it, or zero_grad()'s copy of it
      }
    }
    flat.resting = false;
  }
  TORCH_CHECK(changed == nullptr, where(), "parameter '", *changed,
              "' of the wrapped module was changed in place outside forward, backward and summon_full_params(): "
              "by an optimizer made from model->module()->parameters() (or the module's, before wrapping), an init "
              "such as normal_() or zero_(), a copy_ or torch::load? There it is an empty tensor and the values live "
              "in the shards, so the change is lost. Make optimizers from model->parameters() (this rank's shards), "
              "and make edits inside { auto full = model->summon_full_params(); full.writeback(true); ... } or "
              "before wrapping the module.");
  check_still_frozen_or_trained();
}

// Note [Frozen parameters] in src/fsdp/construct.cpp.
void ShardedCore::State::check_still_frozen_or_trained() const {
  const auto refuse = [&](const std::string& name, bool now) {
    TORCH_CHECK(false, where(), "parameter '", name, "' of the wrapped module ", now ? "started" : "stopped",
                " requiring gradients after the module was wrapped. Which parameters train is fixed when it is "
                "wrapped: ", now ? "a parameter frozen then has no shard in model->parameters(), and its gradient "
                "would not be averaged over the ranks" : "a parameter trained then keeps its shard, which the "
                "optimizer would go on moving (momentum, weight decay)", ". Set requires_grad before wrapping; to "
                "change it later, copy the parameters out under summon_full_params() into a new module (or "
                "torch::save the module there and torch::load a new one), set requires_grad on it, wrap that, and "
                "make a new optimizer.");
  };
  for (const auto& flat : flats) {
    for (size_t j = 0; j < flat.params.size(); ++j) {
      if (!flat.params[j].requires_grad()) {
        refuse(flat.names[j], false);
      }
    }
  }
  for (size_t i = first_frozen; i < whole.size(); ++i) {
    if (whole[i].second.requires_grad()) {
      refuse(whole[i].first, true);
    }
  }
}

void ShardedCore::summon() {
  auto& s = *state_;
  CollectiveTag tag(model_tag(s.model, 0)); // Note [Collective tags]: two models' calls never pair
  TORCH_CHECK(!s.summoned, s.where(), "summon_full_params() inside another; end the first guard.");
  s.check_untouched_at_rest();
  Unwatched unwatched;
  if (s.forwarded) { // Note [Loading between forward and backward]: its graph was dropped, or its backward is an error
    if (s.sharded()) {
      s.forget_gathered();
    }
    s.forwarded = false;
    s.forward_dropped_by = "summon_full_params()";
  }
  if (!s.summon_in_own_dtype()) { // Note [Sharded mixed precision]
    s.gather_all();
  }
  for (auto& flat : s.flats) { // Note [A summon without writeback]
    flat.summon_versions.clear();
    for (const auto& param : flat.params) {
      flat.summon_versions.push_back(param._version());
    }
  }
  s.summoned = true;
}

// Note [A summon without writeback]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch FSDP's summon_full_params writes edits back by default, and code
// ported from Python edits inside the guard expecting them to stay. With
// writeback(false), FullShard's and ShardGradOp's edits would be dropped
// without a word when the guard ends. Any in-place change, and torch::load's
// set_, moves the parameter's version counter, which the gathering itself
// does not (it writes into the buffer the parameters view, not through
// them): so a counter that moved inside the guard is a lost edit, and an
// error naming the parameter once the guard has ended. NoShard's parameters
// view its shard, so there the edit stays and is not refused.
const std::string* ShardedCore::State::edited_while_summoned() const {
  for (const auto& flat : flats) {
    for (size_t j = 0; j < flat.params.size() && j < flat.summon_versions.size(); ++j) {
      if (flat.params[j]._version() != flat.summon_versions[j]) {
        return &flat.names[j];
      }
    }
  }
  return nullptr;
}

void ShardedCore::unsummon(bool writeback) {
  auto& s = *state_;
  const std::string* edited = writeback || !s.sharded() ? nullptr : s.edited_while_summoned();
  end_summon(writeback);
  TORCH_CHECK(edited == nullptr, s.where(), "parameter '", *edited, "' was changed inside summon_full_params() "
              "with writeback(false), so the edit is lost: the shards keep the values they had before the guard. "
              "Leave writeback on (the default) to keep edits, or make none under writeback(false).");
}

void ShardedCore::end_summon(bool writeback) {
  auto& s = *state_;
  Unwatched unwatched;
  s.summoned = false;
  s.adopt_replaced_params(writeback); // Note [Replaced parameters]
  if (writeback && s.sharded()) {
    torch::NoGradGuard no_grad;
    for (auto& flat : s.flats) {
      const auto& whole = flat.summoned.defined() ? flat.summoned : flat.full;
      flat.shard.detach().copy_(whole.narrow(0, s.group.rank() * flat.layout.shard, flat.layout.shard));
    }
  }
  s.release_all();
  for (auto& flat : s.flats) {
    if (flat.summoned.defined()) {
      flat.summoned = torch::Tensor();
      // Their dtype changed twice (Note [Sharded mixed precision]), and
      // set_data forgets a parameter's accumulator when its dtype changes:
      // give back the one that carries the gradient hooks.
      for (size_t j = 0; j < flat.params.size(); ++j) {
        restore_grad_accumulator(flat.params[j], flat.accumulators[j]);
      }
    }
  }
}

// Note [A summon ended by an exception]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A FullParamsGuard's block that throws (a torch::load of another model's
// file, which replaces some parameters and then misses one) ends the guard
// while the exception unwinds, and a destructor that throws then ends the
// process: writeback's own check of a replaced parameter's shape would do
// just that. So an abandoned guard writes nothing back: the edits of a
// block that did not complete are dropped, the shards keep the values they
// had before it, and the module's parameters view the buffers again, ready
// for the next forward; the caller's exception goes on. (Under NoShard the
// module's parameters view the shards themselves, so an in-place edit made
// before the exception stays; a replaced parameter is dropped.) Anything
// that still fails here can only be said on stderr.
void ShardedCore::abandon_summon() noexcept {
  try {
    end_summon(/*writeback=*/false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%ssummon_full_params() ended by an exception could not restore the module's parameters: "
                 "%s\n", state_->where().c_str(), e.what());
  }
}

} // namespace detail
} // namespace lockstep
