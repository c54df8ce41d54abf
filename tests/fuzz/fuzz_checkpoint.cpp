// Fuzz target: lockstep-train's checkpoint loader (examples/checkpoint.h),
// into a small model and an SGD optimizer with momentum. The input is written
// as the checkpoint file. A c10::Error is the right answer to a bad file;
// anything else is a failure, as is a load that returns a model of another
// shape.

#include <examples/checkpoint.h>

#include <torch/torch.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2));
}

} // namespace

// LOCKSTEP_FUZZ_WRITE_SEED=FILE: writes a real checkpoint of this model, one
// step into training, to FILE and exits (tests/fuzz/corpus/fuzz_checkpoint).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* seed = std::getenv("LOCKSTEP_FUZZ_WRITE_SEED");
  if (seed == nullptr) {
    return 0;
  }
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  model->forward(torch::randn({4, 3})).sum().backward();
  optimizer.step();
  lockstep::examples::TrainingState state{0, 64, 1, 2, 64, {1024, 7, 1}, {1.5, 3, 4}};
  lockstep::examples::save_checkpoint(seed, *model, optimizer, state);
  std::exit(0);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/lockstep-fuzz-checkpoint-" + std::to_string(::getpid());
  FILE* out = std::fopen(path.c_str(), "wb");
  std::fwrite(data, 1, size, out);
  std::fclose(out);
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  lockstep::examples::TrainingState state;
  try {
    lockstep::examples::load_checkpoint(path, *model, optimizer, state);
    for (const auto& p : model->named_parameters()) {
      if (p.value().dim() == 0 || p.value().size(-1) > 3) {
        std::abort();
      }
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
