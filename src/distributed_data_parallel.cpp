#include <lockstep/distributed_data_parallel.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

namespace lockstep {
namespace detail {
namespace {

std::string describe(const std::string& name, const torch::Tensor& p) {
  std::ostringstream out;
  out << "'" << name << "' " << p.sizes() << " " << p.scalar_type();
  return out.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
  }
  return lines;
}

} // namespace

void verify_same_parameters(const ProcessGroup& group, const std::vector<std::string>& names, const std::vector<torch::Tensor>& params) {
  std::vector<std::string> mine;
  std::string text;
  for (size_t i = 0; i < params.size(); ++i) {
    mine.push_back(describe(names[i], params[i]));
    text += mine.back() + "\n";
  }
  // Rank 0's description, as bytes: its length first, then the bytes.
  auto length = torch::tensor({static_cast<int64_t>(text.size())}, torch::kLong);
  group.broadcast(length, 0);
  auto bytes = torch::zeros({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == 0) {
    std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  }
  group.broadcast(bytes, 0);
  const auto reference = split_lines(std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), bytes.numel()));

  int64_t first_difference = -1;
  for (size_t i = 0; i < std::max(mine.size(), reference.size()); ++i) {
    if (i >= mine.size() || i >= reference.size() || mine[i] != reference[i]) {
      first_difference = static_cast<int64_t>(i);
      break;
    }
  }
  // Every rank learns every rank's verdict, so that all of them throw.
  auto verdicts = group.all_gather(torch::tensor({first_difference, static_cast<int64_t>(mine.size())}, torch::kLong));
  for (int r = 0; r < group.size(); ++r) {
    const auto index = verdicts[r][0].item<int64_t>();
    const auto count = verdicts[r][1].item<int64_t>();
    if (index < 0) {
      continue;
    }
    const std::string rank0 = index < static_cast<int64_t>(reference.size())
        ? reference[index]
        : "no parameter " + std::to_string(index) + " (it has " + std::to_string(reference.size()) + ")";
    std::string theirs;
    if (r == group.rank()) {
      theirs = index < static_cast<int64_t>(mine.size()) ? mine[index]
                                                          : "no parameter " + std::to_string(index) + " (it has " + std::to_string(count) + ")";
    } else {
      theirs = "something else (its own error says what)";
    }
    TORCH_CHECK(false, "lockstep::DistributedDataParallel: rank ", group.rank(), ": rank ", r,
                "'s parameters differ from rank 0's at parameter ", index, ": rank 0 has ", rank0, ", rank ", r, " has ",
                theirs, ". Every rank must build the same model, with the same parameters in the same order.");
  }
}

void broadcast_coalesced(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors, int root, const std::string& what) {
  if (tensors.empty()) {
    return;
  }
  torch::NoGradGuard no_grad;
  std::map<std::string, std::vector<torch::Tensor>> by_kind;
  for (const auto& t : tensors) {
    by_kind[std::string(c10::toString(t.scalar_type())) + "@" + t.device().str()].push_back(t);
  }
  for (auto& [kind, group_tensors] : by_kind) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : group_tensors) {
      flat_parts.push_back(t.reshape({-1}));
    }
    auto flat = torch::cat(flat_parts);
    group.broadcast_async({flat}, root, what)->wait();
    int64_t offset = 0;
    for (auto& t : group_tensors) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

DistributedCore::DistributedCore(torch::nn::Module& module, ProcessGroup group, const DistributedOptions& options)
    : group_(std::move(group)), broadcast_buffers_(options.broadcast_buffers()) {
  TORCH_CHECK(options.bucket_bytes() > 0 && options.first_bucket_bytes() > 0,
              "lockstep::DistributedDataParallel: bucket_bytes and first_bucket_bytes must be > 0, but got ",
              options.bucket_bytes(), " and ", options.first_bucket_bytes(), ".");
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  for (const auto& named : module.named_parameters()) {
    if (named.value().requires_grad()) {
      names.push_back(named.key());
      params.push_back(named.value());
    }
  }
  TORCH_CHECK(!params.empty(), "lockstep::DistributedDataParallel: the module has no parameter that requires a "
              "gradient, so there is nothing to reduce.");
  verify_same_parameters(group_, names, params);
  buffers_ = module.buffers();
  auto everything = module.parameters();
  everything.insert(everything.end(), buffers_.begin(), buffers_.end());
  broadcast_coalesced(group_, everything, 0, "the broadcast of rank 0's parameters and buffers");
  reducer_ = std::make_unique<Reducer>(std::move(params), std::move(names), group_, options);
}

void DistributedCore::before_forward() {
  if (broadcast_buffers_ && sync_) {
    broadcast_coalesced(group_, buffers_, 0, "the broadcast of rank 0's buffers");
  }
  reducer_->prepare_for_backward(sync_ && torch::GradMode::is_enabled());
}

} // namespace detail
} // namespace lockstep
