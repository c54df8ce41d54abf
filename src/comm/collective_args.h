#pragma once

// Internal: what ProcessGroup does around a backend's collective, the same
// for every backend (Note [One tensor per collective] in
// src/comm/collective_args.cpp): it refuses at the call what no backend can do,
// turns a list of tensors into one contiguous tensor, picks a type of the
// same width for a dtype the backend cannot carry, and finishes the result
// (Avg's division, the copy back) in wait().

#include <lockstep/backend.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// Throws the c10::Error of a collective this rank refuses before anything
/// is sent: "lockstep: rank R of N: <what>: refused on this rank before
/// anything was sent (<backend> backend): <reason>".
[[noreturn]] void refuse(const GroupImpl& group, const std::string& what, const std::string& reason);

/// Refuses an empty list, undefined or non-dense tensors, and a list of
/// several dtypes or devices.
void check_tensor_list(const GroupImpl& group, const std::vector<torch::Tensor>& tensors, const std::string& what);

/// The dtype that carries `dtype` for `op` over `group`: `dtype` itself when
/// the backend supports it; for a copy (broadcast, all_gather, or Max and
/// Min of bools), a supported type of the same width; Undefined if none.
torch::ScalarType carrier_of(const GroupImpl& group, Collective op, torch::ScalarType dtype, torch::Device device);

/// `carrier_of`, or a refusal naming the dtype, the backend and what to do.
torch::ScalarType carrier_or_refuse(
    const GroupImpl& group,
    Collective op,
    const torch::Tensor& example,
    const std::string& what);

/// The caller's tensors as the one contiguous tensor a backend gets.
struct Packed {
  std::vector<torch::Tensor> tensors; // the caller's
  torch::Tensor flat; // the caller's own tensor, or a copy of all of them, in their dtype
  torch::Tensor sent; // `flat`, viewed as the carrier dtype
  bool copied = false; // results must be copied back into `tensors`
};

/// Packs `tensors` (checked by check_tensor_list) for a backend.
Packed pack(const std::vector<torch::Tensor>& tensors, torch::ScalarType carrier);

/// Whether Avg divides before the sum (Note [Average] in
/// src/comm/process_group.cpp): for float16, whose sum may overflow.
bool divides_first(const torch::Tensor& t, ReduceOp op);

/// Whether Avg sums in int64 (Note [Average] in src/comm/process_group.cpp):
/// for integers narrower than it, whose sum may overflow where their
/// average cannot.
bool widens(const torch::Tensor& t, ReduceOp op);

/// `packed` as int64, in a copy of its own, sent in its place and copied
/// back (narrowed) at the end.
void widen(Packed& packed);

/// `packed` divided by `divisor` into a copy of its own, sent in its place
/// and copied back at the end: the caller's tensors keep their values until
/// the collective is done.
void divide_first(Packed& packed, int divisor);

/// A backend's Work, then, once it is done: Avg's division (divisor > 0)
/// and the copy back into the caller's tensors, once.
std::shared_ptr<Work> finish_after(std::shared_ptr<Work> work, Packed packed, int divisor);

/// `work`, then `then()` once, on the first wait() that succeeds.
std::shared_ptr<Work> then(std::shared_ptr<Work> work, std::function<void()> then);

/// Refuses a reduce_scatter or all_gather_into whose `whole` (size()*n
/// elements) and `part` (n) are not dense, contiguous, of one dtype and
/// device, and of those sizes.
void check_flat_pair(const GroupImpl& group, const torch::Tensor& whole, const torch::Tensor& part, const std::string& what);

} // namespace detail
} // namespace lockstep
