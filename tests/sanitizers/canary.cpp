// Proof that a sanitizer build reports what it is there to report: each mode
// makes one deliberate error of the kind its sanitizer finds, and the ctest
// that runs it passes only on the sanitizer's report. Without it, a build
// whose flags were lost, or run-time options that hide lockstep's own code
// (TSan's ignore_noninstrumented_modules, the suppression files), would pass
// the suite just the same. Built in sanitizer builds only.
//   race      (TSan) two DataParallel replicas write one int from forward
//   overflow  (ASan) a read one element past a tensor LibTorch allocated
//   undefined (UBSan) a signed integer overflow
//   leak      (LSan) memory allocated and lost

#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

namespace {

int shared_calls = 0; // written by both replicas: the race
std::atomic<int> arrived{0};

// Each replica's forward waits until both have arrived, through a relaxed
// atomic (which orders nothing for TSan), so the two writes always overlap.
struct RacyImpl : torch::nn::Cloneable<RacyImpl> {
  RacyImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(2, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    arrived.fetch_add(1, std::memory_order_relaxed);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load(std::memory_order_relaxed) < 2 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
    ++shared_calls;
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Racy);

void race() {
  lockstep::DataParallel<Racy> dp(
      Racy(), lockstep::DataParallelOptions().devices(std::vector<torch::Device>(2, torch::Device(torch::kCPU))));
  dp(torch::ones({2, 2}));
  std::printf("forward ran %d times\n", shared_calls);
}

void overflow() {
  auto t = torch::ones({3});
  volatile int past_the_end = 3;
  std::printf("read %f\n", static_cast<double>(t.data_ptr<float>()[past_the_end]));
}

void undefined() {
  volatile int one = 1;
  const int max = INT_MAX;
  std::printf("sum %d\n", max + one);
}

void leak() {
  volatile char* lost = new char[100];
  lost[0] = 1;
  lost = nullptr;
}

} // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "race") == 0) {
    race();
  } else if (std::strcmp(mode, "overflow") == 0) {
    overflow();
  } else if (std::strcmp(mode, "undefined") == 0) {
    undefined();
  } else if (std::strcmp(mode, "leak") == 0) {
    leak();
  } else {
    std::fprintf(stderr, "usage: %s race|overflow|undefined|leak\n", argv[0]);
    return 2;
  }
  return 0;
}
