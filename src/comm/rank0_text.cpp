#include "comm/rank0_text.h"

#include <torch/torch.h>

#include <cstring>
#include <sstream>

namespace lockstep {
namespace detail {

std::string rank0_text(const ProcessGroup& group, const std::string& text, torch::Device device,
                       const std::string& what) {
  auto length = torch::tensor({static_cast<int64_t>(text.size())}, torch::kLong).to(device);
  group.broadcast_async({length}, 0, what)->wait();
  auto bytes = torch::zeros({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == 0) {
    std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  }
  bytes = bytes.to(device);
  group.broadcast_async({bytes}, 0, what)->wait();
  bytes = bytes.cpu();
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), bytes.numel());
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
  }
  return lines;
}

} // namespace detail
} // namespace lockstep
