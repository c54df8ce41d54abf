// Compiled when LibTorch has c10d's NCCL process group (a CUDA build with
// USE_C10D_NCCL); no_nccl.cpp otherwise. It has run with a group of one on
// one GPU, never with two ranks (README, "On a GPU").

#include "comm/backends/backends.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace lockstep {
namespace detail {
namespace {

// c10d's NCCL group takes CUDA tensors only. NCCL has no 16-bit integers
// (c10d's ncclDataType map), which the copies then carry as a dtype of the
// same width (carrier_of); complex ones c10d sends as their real parts.
class NcclGroup final : public C10dGroup<c10d::ProcessGroupNCCL> {
 public:
  using C10dGroup::C10dGroup;
  bool supports(Collective, torch::ScalarType dtype, torch::Device device) const override {
    return device.is_cuda() && dtype != torch::kShort;
  }
  // A collective is a kernel on a stream: its start costs microseconds.
  bool cheap_collective_starts() const override {
    return true;
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what)
      override {
    if (output.numel() == 0) {
      return std::make_shared<DoneWork>();
    }
    c10d::ReduceScatterOptions options;
    options.reduceOp = to_c10d(op);
    return wrap([&] { return c10d_group()._reduce_scatter_base(output, input, options); }, std::move(what));
  }
};

} // namespace

bool nccl_available() {
  return true;
}

std::shared_ptr<GroupImpl> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  return std::make_shared<NcclGroup>(std::move(group), "nccl", timeout);
}

} // namespace detail
} // namespace lockstep
