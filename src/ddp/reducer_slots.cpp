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
//    to none, or a slot already) becomes its slot, which holds the average.
//    A .grad held elsewhere too, or a view of memory that something else
//    holds, gets the average by copy, as in PyTorch, and stays the tensor it
//    was.
//  - The caller may then take a slot (auto kept = p.grad()). In PyTorch
//    that tensor keeps its values through the next backward, which makes a
//    new .grad. So before a backward first writes into a bucket
//    (writable_slot), if anything but the reducer and the parameters' .grad
//    holds the bucket's memory, the tensors on it move to a private copy of
//    its bytes, and the bucket goes on in its own memory (which other ranks
//    may map: Note [Buffers every rank can reach]) with new tensors. This
//    copy is made only then. A .grad that only its parameter held moves back
//    to its new slot, where the same bytes lie.
// So the values, and which tensors they are in, are PyTorch's. What differs
// is what a .grad's storage is: the bucket's (its storage() holds the other
// parameters' gradients too), as under gradient_as_bucket_view. On the CPU
// that option still matters: with it, .grad is the slot whoever holds it,
// and backward accumulates into the bucket.
// On the MLP over MPI on two cores, side by side, this made DDP's step
// faster by the copy it saves and the memory it no longer touches
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

// Whether anything but the reducer's own tensors and the parameters' .grad
// holds the bucket's memory: each tensor on it holds the storage once, and
// a tensor handle (a .grad the caller took) holds its tensor once.
bool Reducer::State::held_elsewhere(const Bucket& bucket) const {
  if (bucket.buffer.use_count() != 1 || bucket.buffer.storage().use_count() != bucket.own_references) {
    return true;
  }
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const torch::Tensor& grad = params[bucket.params[k]].grad();
    const bool is_grad = grad.defined() && grad.unsafeGetTensorImpl() == bucket.views[k].unsafeGetTensorImpl();
    if (bucket.views[k].use_count() != (is_grad ? 2u : 1u)) {
      return true;
    }
  }
  return false;
}

// The tensors on the bucket's storage keep it, now over a private copy of its
// bytes; the bucket takes its memory back under a storage of its own.
void Reducer::State::move_out_holders(Bucket& bucket) {
  TORCH_INTERNAL_ASSERT(bucket.buffer.is_cpu());
  timeline::Span span("a copy of a bucket for the tensors held on it", bucket.bytes);
  torch::NoGradGuard no_grad;
  auto* storage = bucket.buffer.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  c10::DataPtr copy = c10::GetCPUAllocator()->allocate(bytes);
  if (bytes > 0) {
    std::memcpy(copy.get(), storage->data_ptr().get(), bytes);
  }
  c10::Storage own(c10::Storage::use_byte_size_t(), static_cast<int64_t>(bytes), storage->set_data_ptr(std::move(copy)),
                   /*allocator=*/nullptr, /*resizable=*/false);
  const auto on_own = [&own](const torch::Tensor& t) {
    return torch::empty({0}, t.options()).set_(own, t.storage_offset(), t.sizes(), t.strides());
  };
  bucket.buffer = on_own(bucket.buffer);
  std::vector<torch::Tensor> held = std::move(bucket.views);
  bucket.views.clear();
  for (const auto& view : held) {
    bucket.views.push_back(on_own(view));
  }
  bucket.own_references = own.use_count() - 1; // less `own` itself
  for (size_t k = 0; k < held.size(); ++k) {
    auto& grad = params[bucket.params[k]].mutable_grad();
    if (grad.defined() && grad.unsafeGetTensorImpl() == held[k].unsafeGetTensorImpl() && held[k].use_count() == 2) {
      grad = bucket.views[k];
    }
  }
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
