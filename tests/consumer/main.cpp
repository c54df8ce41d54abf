#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  lockstep::DataParallel<torch::nn::Sequential> dp(
      net, lockstep::DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  auto x = torch::randn({6, 4});
  auto y = dp->forward(x);
  auto expected = net->forward(x);
  // Replicas multiply half the batch each: BLAS may round differently.
  if (!torch::allclose(y, expected, /*rtol=*/1e-5, /*atol=*/1e-6)) {
    std::cerr << "consumer: DataParallel output differs from the bare module\n";
    return 1;
  }
  std::cout << "consumer: ok " << y.sizes() << "\n";
  return 0;
}
