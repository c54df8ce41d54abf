#include "comm/collective_args.h"
#include "comm/forwarding_work.h"

#include <lockstep/detail/c10d_group.h>

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include <optional>
#include <utility>

namespace lockstep {
namespace detail {

// Note [One tensor per collective]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// process_group.h promises that a list of tensors is reduced or broadcast
// tensor by tensor. c10d reads a list otherwise: one tensor per device, all
// combined into one result (Gloo gave [40], [40] for the sums [10], [30]).
// So every backend gets one contiguous tensor per collective, made here once
// for all of them, as c10d's allreduce_coalesced does: the caller's own
// tensor when it is alone and contiguous, else a flat copy of the list,
// copied back in wait(). A list therefore holds one dtype on one device;
// anything else is refused before anything is sent, on this rank, so that
// the error reads as this rank's and not as a timeout (which is what it
// became when c10d refused it inside the collective).
//
// A backend says which dtypes it carries (GroupImpl::supports). Broadcast
// and all_gather only copy bits, so a dtype it lacks goes as a supported
// type of the same width: bool as bytes, bfloat16 as 16-bit values. That is
// exact for every value, NaN payloads included. A reduction computes, so an
// unsupported dtype is refused at the call, naming it and the backend; the
// one exception is bool, whose Max and Min are those of its bytes, 0 and 1.

[[noreturn]] void refuse(const GroupImpl& group, const std::string& what, const std::string& reason) {
  throw_refusal(what, group.rank(), group.size(), group.backend(), reason);
}

void check_tensor_list(const GroupImpl& group, const std::vector<torch::Tensor>& tensors, const std::string& what) {
  if (tensors.empty()) {
    refuse(group, what, "the list holds no tensors. Pass one or more; an empty tensor (numel() == 0) is fine.");
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const std::string name = "tensors[" + std::to_string(i) + "]";
    if (!t.defined()) {
      refuse(group, what, name + " is an undefined tensor; pass a tensor with storage.");
    }
    if (t.layout() != torch::kStrided) {
      refuse(group, what, name + " is a " + c10::str(t.layout()) + " tensor; collectives take dense tensors: call "
             ".to_dense() first.");
    }
    if (t.scalar_type() != tensors[0].scalar_type()) {
      refuse(group, what, name + " is " + c10::toString(t.scalar_type()) + " but tensors[0] is " +
             c10::toString(tensors[0].scalar_type()) + ": one collective carries one dtype. Call it once per dtype.");
    }
    if (t.device() != tensors[0].device()) {
      refuse(group, what, name + " is on " + t.device().str() + " but tensors[0] is on " + tensors[0].device().str() +
             ": one collective runs on one device. Call it once per device.");
    }
  }
}

void check_flat_pair(const GroupImpl& group, const torch::Tensor& whole, const torch::Tensor& part, const std::string& what) {
  check_tensor_list(group, {whole, part}, what);
  if (!whole.is_contiguous() || !part.is_contiguous()) {
    refuse(group, what, "both tensors must be contiguous (the flat buffers of a sharded model are); call .contiguous() "
           "and copy the result back.");
  }
  if (whole.numel() != part.numel() * group.size()) {
    refuse(group, what, "the whole tensor has " + std::to_string(whole.numel()) + " elements but the shard has " +
           std::to_string(part.numel()) + ", and a group of " + std::to_string(group.size()) + " needs " +
           std::to_string(part.numel() * group.size()) + ": pad the whole to a multiple of the group's size.");
  }
}

namespace {

// The types a backend may carry in place of another of the same width.
std::vector<torch::ScalarType> same_width(torch::ScalarType dtype) {
  switch (c10::elementSize(dtype)) {
    case 1:
      return {torch::kByte, torch::kChar, torch::kBool};
    case 2:
      return {torch::kShort, torch::kHalf, torch::kBFloat16};
    case 4:
      return {torch::kInt, torch::kFloat};
    case 8:
      return {torch::kLong, torch::kDouble};
    default:
      return {};
  }
}

} // namespace

torch::ScalarType carrier_of(const GroupImpl& group, Collective op, torch::ScalarType dtype, torch::Device device) {
  if (group.supports(op, dtype, device)) {
    return dtype;
  }
  // A reduction reaches here only for bool's Max and Min (Sum is turned into Max).
  const bool reduces = op == Collective::Allreduce || op == Collective::ReduceScatter;
  if (reduces && dtype != torch::kBool) {
    return torch::ScalarType::Undefined;
  }
  for (auto other : same_width(dtype)) {
    if (other != dtype && group.supports(op, other, device)) {
      return other;
    }
  }
  return torch::ScalarType::Undefined;
}

torch::ScalarType carrier_or_refuse(
    const GroupImpl& group,
    Collective op,
    const torch::Tensor& example,
    const std::string& what) {
  const auto dtype = example.scalar_type();
  const auto carrier = carrier_of(group, op, dtype, example.device());
  if (carrier != torch::ScalarType::Undefined) {
    return carrier;
  }
  const auto device = example.device();
  if (!group.supports(op, torch::kFloat, device) && !group.supports(op, torch::kLong, device)) {
    if (device.is_cpu()) {
      refuse(group, what, "the " + group.backend() + " backend takes no tensors on the CPU (NCCL's takes CUDA "
             "tensors only). Send a copy on the GPU (t.to(torch::kCUDA)), or make a gloo group for CPU tensors.");
    }
    refuse(group, what, "the " + group.backend() + " backend takes no tensors on " + device.str() + ". " +
           (group.supports(op, torch::kFloat, torch::kCPU) ? "Send a copy on the CPU, or use" : "Use") +
           " a backend for " + c10::DeviceTypeName(device.type(), /*lower_case=*/true) +
           " tensors (nccl for CUDA ones; \"auto\" picks it where a GPU is visible).");
  }
  const bool reduce = op == Collective::Allreduce || op == Collective::ReduceScatter;
  refuse(group, what, "the " + group.backend() + " backend of this build cannot " + (reduce ? "reduce " : "carry ") +
         c10::toString(dtype) + " tensors on " + example.device().str() + ". " +
         (reduce ? "Reduce a copy in a type it has (float32 for 16-bit floats: t.to(torch::kFloat)), and cast back."
                 : "Send a copy in a type it has, and cast back."));
}

Packed pack(const std::vector<torch::Tensor>& tensors, torch::ScalarType carrier) {
  Packed packed;
  packed.tensors = tensors;
  if (tensors.size() == 1 && tensors[0].is_contiguous()) {
    packed.flat = tensors[0];
  } else {
    std::vector<torch::Tensor> parts;
    parts.reserve(tensors.size());
    for (const auto& t : tensors) {
      parts.push_back(t.reshape({-1}));
    }
    packed.flat = torch::cat(parts);
    packed.copied = true;
  }
  packed.sent = carrier == packed.flat.scalar_type() ? packed.flat : packed.flat.view(carrier);
  return packed;
}

bool divides_first(const torch::Tensor& t, ReduceOp op) {
  return op == ReduceOp::Avg && t.scalar_type() == torch::kHalf;
}

bool widens(const torch::Tensor& t, ReduceOp op) {
  const auto dtype = t.scalar_type();
  return op == ReduceOp::Avg &&
      (dtype == torch::kByte || dtype == torch::kChar || dtype == torch::kShort || dtype == torch::kInt);
}

void widen(Packed& packed) {
  torch::NoGradGuard no_grad;
  packed.flat = packed.flat.to(torch::kLong).reshape({-1});
  packed.sent = packed.flat;
  packed.copied = true;
}

void divide_first(Packed& packed, int divisor) {
  torch::NoGradGuard no_grad;
  const auto carrier = packed.sent.scalar_type();
  packed.flat = (packed.flat / divisor).reshape({-1}); // a copy, so one with wait()'s 1-D view, whatever the shape
  packed.sent = carrier == packed.flat.scalar_type() ? packed.flat : packed.flat.view(carrier);
  packed.copied = true;
}

namespace {

class FinishedWork : public ForwardingWork {
 public:
  FinishedWork(std::shared_ptr<Work> work, Packed packed, int divisor)
      : ForwardingWork(std::move(work)), packed_(std::move(packed)), divisor_(divisor) {}

  void wait() override {
    inner_->wait();
    if (finished_) {
      return; // a second wait() must not divide or copy again
    }
    finished_ = true;
    // The results are data: a collective over a parameter that requires a
    // gradient writes into it in place, as an optimizer does.
    torch::NoGradGuard no_grad;
    if (divisor_ > 0) {
      // Note [Average] in src/comm/process_group.cpp. The caller's own
      // tensor may be an inference tensor (Note [Inference tensors]).
      std::optional<c10::InferenceMode> inference;
      if (packed_.flat.is_inference()) {
        inference.emplace();
      }
      if (c10::isIntegralType(packed_.flat.scalar_type(), /*includeBool=*/false)) {
        packed_.flat.div_(divisor_, "floor");
      } else {
        packed_.flat.div_(divisor_);
      }
    }
    if (packed_.copied) {
      int64_t offset = 0;
      for (auto& t : packed_.tensors) {
        std::optional<c10::InferenceMode> inference; // Note [Inference tensors]: only it writes them
        if (t.is_inference()) {
          inference.emplace();
        }
        t.copy_(packed_.flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }

 private:
  Packed packed_;
  int divisor_;
  bool finished_ = false;
};

class ThenWork : public ForwardingWork {
 public:
  ThenWork(std::shared_ptr<Work> work, std::function<void()> then)
      : ForwardingWork(std::move(work)), then_(std::move(then)) {}
  void wait() override {
    inner_->wait();
    if (then_) {
      auto then = std::move(then_);
      then_ = nullptr;
      then();
    }
  }

 private:
  std::function<void()> then_;
};

} // namespace

std::shared_ptr<Work> then(std::shared_ptr<Work> work, std::function<void()> then) {
  return std::make_shared<ThenWork>(std::move(work), std::move(then));
}

std::shared_ptr<Work> finish_after(std::shared_ptr<Work> work, Packed packed, int divisor) {
  if (divisor <= 0 && !packed.copied) {
    return work;
  }
  return std::make_shared<FinishedWork>(std::move(work), std::move(packed), divisor);
}

} // namespace detail
} // namespace lockstep
