// .grad as its bucket slot without gradient_as_bucket_view, wherever no one
// can tell (Note [Gradients that are bucket slots]).

#include "ddp/reducer_state.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

#include <cstring>

namespace lockstep {
namespace detail {

// Note [Gradients that are bucket slots]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without gradient_as_bucket_view, PyTorch's reducer copies each bucket's
// averages back into .grad: on a CPU, a pass over every gradient's bytes
// each step on the cores that compute, and a second copy of the gradients
// in memory. For CPU parameters the reducer makes .grad the bucket slot
// instead wherever no one can tell, and copies where someone could:
//  - At the end of backward, a .grad that nothing but its parameter holds
//    (the tensor autograd made in this backward after zero_grad() set .grad
//    to none), in the slot's layout, becomes its slot, which holds the
//    average. A .grad held elsewhere too, or a view of memory that something
//    else holds, gets the average by copy, as in PyTorch, and stays the
//    tensor it was.
//  - The caller may then keep a slot (auto kept = p.grad()). In PyTorch that
//    tensor keeps its values through the next backward, which makes a new
//    .grad after zero_grad() set it to none. So before the reducer first
//    writes into a bucket in a backward (writable_slot), if any tensor but
//    the reducer's own (the buffer, the slots) is on the bucket's storage, or
//    a slot has a handle besides the reducer's and its parameter's .grad,
//    the tensors on it keep their values and the bucket goes on with a copy:
//    a bucket of its own memory moves to a clone of itself, while one in
//    memory that every rank maps (Note [Buffers every rank can reach]), which
//    cannot move, gives the held tensors a private copy of its bytes under
//    their storage (so their data_ptr() changes). That copy is made only
//    then. A .grad that is a slot and that only its parameter holds follows
//    the bucket, where the same bytes lie, unless another tensor is on the
//    storage: that tensor may be a view of the .grad, and must keep seeing
//    what .grad holds (zero_grad() in place, accumulation, the next average
//    by copy), as in PyTorch.
// So which tensors hold the values is PyTorch's, and the values are too but
// for the average's rounding (Note [An average divided where it is summed]). What differs:
// a .grad's storage() is the bucket's, holding the other parameters'
// gradients too, as under gradient_as_bucket_view; and the reduction writes
// a slot that is .grad through the reducer's own tensors, so an autograd
// graph that saved that .grad sees no version change. On the CPU
// gradient_as_bucket_view still matters: with it, .grad is the slot whoever
// holds it, and the next backward writes the slot a kept .grad is.
// On the MLP on two cores, side by side, DDP's steps per second rose 1.01
// to 1.10 x over MPI, 1.04 x over Gloo and 1.06 x under PowerSGD
// (docs/performance.md, "DDP on CPU").

// Under gradient_as_bucket_view a kept .grad is the slot, as in PyTorch:
// the next backward accumulates into it, and the average replaces it.
torch::Tensor& Reducer::State::writable_slot(size_t index) {
  auto& bucket = buckets[slot_of[index].first];
  if (!bucket.checked && !options.gradient_as_bucket_view() && bucket.buffer.is_cpu()) {
    bucket.checked = true;
    if (held_elsewhere(bucket)) {
      move_out_holders(bucket);
    }
  }
  return bucket.views[slot_of[index].second];
}

namespace {

// Tensors on the bucket's storage besides the buffer and its slots. A
// tensor handle counts once on its tensor, and a tensor once on its
// storage; a tensor made from the storage's raw address (a backend's
// from_blob during a collective) is not counted, and does not outlive it.
size_t others_on_storage(const torch::Tensor& buffer, size_t slots) {
  const size_t on = buffer.storage().use_count();
  return on > 1 + slots ? on - 1 - slots : 0;
}

} // namespace

// Whether something besides the reducer and each parameter's .grad holds
// the bucket's memory. A handle on the buffer itself is not counted: a
// comm hook that keeps GradBucket::buffer sees it change, as in PyTorch.
bool Reducer::State::held_elsewhere(const Bucket& bucket) const {
  if (others_on_storage(bucket.buffer, bucket.views.size()) > 0) {
    return true;
  }
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const torch::Tensor& grad = params[bucket.params[k]].grad();
    const bool is_grad = grad.defined() && grad.unsafeGetTensorImpl() == bucket.views[k].unsafeGetTensorImpl();
    if (bucket.views[k].use_count() > (is_grad ? 2u : 1u)) {
      return true;
    }
  }
  return false;
}

// The tensors on the bucket's storage keep their values; the bucket goes on
// with new tensors over a clone of its bytes, or, in shared memory, over its
// own memory while the held tensors take a private copy.
void Reducer::State::move_out_holders(Bucket& bucket) {
  TORCH_INTERNAL_ASSERT(bucket.buffer.is_cpu());
  timeline::Span span("a copy of a bucket for the tensors held on it", bucket.bytes);
  torch::NoGradGuard no_grad;
  const bool views_of_grads_may_exist = others_on_storage(bucket.buffer, bucket.views.size()) > 0;
  c10::Storage own;
  if (bucket.shared) {
    auto* storage = bucket.buffer.storage().unsafeGetStorageImpl();
    const size_t bytes = storage->nbytes();
    c10::DataPtr copy = c10::GetCPUAllocator()->allocate(bytes);
    if (bytes > 0) {
      std::memcpy(copy.get(), storage->data_ptr().get(), bytes);
    }
    own = c10::Storage(c10::Storage::use_byte_size_t(), bytes, storage->set_data_ptr(std::move(copy)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  } else {
    own = bucket.buffer.clone().storage(); // the buffer spans its storage
  }
  const auto on_own = [&own](const torch::Tensor& t) {
    return torch::empty({0}, t.options()).set_(own, t.storage_offset(), t.sizes(), t.strides());
  };
  bucket.buffer = on_own(bucket.buffer);
  std::vector<torch::Tensor> held = std::move(bucket.views);
  bucket.views.clear();
  for (const auto& view : held) {
    bucket.views.push_back(on_own(view));
  }
  for (size_t k = 0; k < held.size() && !views_of_grads_may_exist; ++k) {
    auto& grad = params[bucket.params[k]].mutable_grad();
    if (grad.defined() && grad.unsafeGetTensorImpl() == held[k].unsafeGetTensorImpl() && held[k].use_count() == 2) {
      grad = bucket.views[k];
    }
  }
}

// Under gradient_as_bucket_view every .grad; otherwise each that is a slot
// of a bucket nothing else holds, which may follow it as move_out_holders'
// do.
std::vector<char> Reducer::State::gradients_to_move() const {
  std::vector<char> moving(params.size(), options.gradient_as_bucket_view() ? 1 : 0);
  for (const auto& old : buckets) {
    if (held_elsewhere(old)) {
      continue;
    }
    for (size_t k = 0; k < old.params.size(); ++k) {
      const auto& grad = params[old.params[k]].grad();
      moving[old.params[k]] |= grad.defined() && grad.unsafeGetTensorImpl() == old.views[k].unsafeGetTensorImpl();
    }
  }
  return moving;
}

// The slot may replace a .grad that nothing else holds, in the layout
// autograd gives .grad (the parameter's strides): a transposed matrix's slot
// is row-major (slot_strides).
bool Reducer::State::slot_may_become_grad(size_t index, const torch::Tensor& slot) const {
  const auto& param = params[index];
  const auto& grad = param.grad();
  if (!param.is_cpu() || slot.strides() != (grad.defined() ? grad.strides() : param.strides())) {
    return false;
  }
  return !grad.defined() || (grad.use_count() == 1 && grad.storage().use_count() == 1 && !grad.requires_grad() &&
                             grad.layout() == torch::kStrided);
}

} // namespace detail
} // namespace lockstep
