// Must not compile: a std::deque of tensors is neither a container
// DataParallel walks nor a plain value, so passing one is a compile-time
// error whose message says what to do (Note [One list of walkable types]).
// tests/CMakeLists.txt builds it and expects that message.

#include <lockstep/data_parallel.h>

#include <deque>

struct DequeNetImpl : torch::nn::Cloneable<DequeNetImpl> {
  void reset() override {}
  torch::Tensor forward(std::deque<torch::Tensor> xs) {
    return xs.front();
  }
};
TORCH_MODULE(DequeNet);

int main() {
  lockstep::DataParallel<DequeNet> dp(DequeNet(), lockstep::DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  std::deque<torch::Tensor> xs{torch::ones({2, 2})};
  dp(xs);
}
