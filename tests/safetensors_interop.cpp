// The C++ side of tests/python/safetensors_interop.py: files that Python's
// safetensors package must read, and files of it that lockstep must read.
//   lockstep_safetensors_interop write-patterns FILE  every dtype, known bytes
//   lockstep_safetensors_interop check-patterns FILE  exit 1 unless FILE holds them
//   lockstep_safetensors_interop cnn-save MODEL IO     a CNN with BatchNorm, its input and output
//   lockstep_safetensors_interop cnn-check MODEL IO    exit 1 unless MODEL gives IO's output within 1e-6
// and the C++ side of tests/python/dcp_interop.py, FullyShardedDataParallel
// over WORLD ranks (threads) and PyTorch's distributed checkpoint layout:
//   lockstep_safetensors_interop fsdp-save-dcp DIR WORLD REF  one Adam step, save_sharded(model, adam, DIR);
//                                                             the whole state and Adam's to REF
//   lockstep_safetensors_interop fsdp-load-dcp DIR WORLD REF  load_sharded(model, adam, DIR); exit 1 unless
//                                                             it is REF's

#include <lockstep/lockstep.h>

#include "../src/io/safetensors_format.h"
#include "../src/util/torch_compat.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <cstring>
#include <iostream>
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

std::vector<std::string> dtype_names() {
  std::vector<std::string> names{"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64"};
  for (const auto& [name, dtype] : lockstep::detail::versioned_safetensors_dtypes()) {
    names.push_back(name);
  }
  return names;
}

// Tensor i of the patterns: shape [3, 5], byte k = (31 k + 7 i) mod 251,
// or mod 2 for BOOL (python/safetensors_interop.py makes the same).
torch::Tensor pattern(const std::string& name, int i) {
  c10::ScalarType dtype;
  TORCH_CHECK(lockstep::detail::safetensors_dtype(name, dtype));
  auto tensor = torch::empty({3, 5}, torch::TensorOptions().dtype(dtype));
  auto* bytes = static_cast<unsigned char*>(tensor.data_ptr());
  for (size_t k = 0; k < tensor.nbytes(); ++k) {
    bytes[k] = static_cast<unsigned char>((31 * k + 7 * i) % (name == "BOOL" ? 2 : 251));
  }
  return tensor;
}

int write_patterns(const std::string& path) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  const auto names = dtype_names();
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    tensors.insert("t_" + names[i], pattern(names[i], static_cast<int>(i)));
    list += (i == 0 ? "" : ",") + names[i];
  }
  lockstep::write_safetensors(tensors, path, {{"dtypes", list}});
  return 0;
}

int check_patterns(const std::string& path) {
  const auto read = lockstep::read_safetensors(path);
  const auto names = dtype_names();
  int failures = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto expected = pattern(names[i], static_cast<int>(i));
    const std::string key = "t_" + names[i];
    const bool same = read.contains(key) && read[key].scalar_type() == expected.scalar_type() &&
        read[key].sizes() == expected.sizes() &&
        std::memcmp(read[key].contiguous().data_ptr(), expected.data_ptr(), expected.nbytes()) == 0;
    if (!same) {
      std::cerr << path << ": " << key << " is not the pattern\n";
      ++failures;
    }
  }
  std::cout << "check-patterns: " << names.size() - failures << " of " << names.size() << " dtypes bitwise\n";
  return failures == 0 ? 0 : 1;
}

// The same layers as python/safetensors_interop.py's, so the names match.
torch::nn::Sequential cnn() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)), torch::nn::BatchNorm2d(4),
                               torch::nn::ReLU(), torch::nn::Flatten(), torch::nn::Linear(4 * 6 * 6, 3));
}

int cnn_save(const std::string& model_path, const std::string& io_path) {
  torch::manual_seed(0);
  auto model = cnn();
  model->forward(torch::randn({16, 1, 8, 8}) * 2 + 1); // running statistics far from the defaults
  model->eval();
  torch::OrderedDict<std::string, torch::Tensor> io;
  io.insert("x", torch::randn({4, 1, 8, 8}));
  io.insert("y", model->forward(io["x"]).detach());
  lockstep::save_safetensors(model, model_path);
  lockstep::write_safetensors(io, io_path);
  return 0;
}

int cnn_check(const std::string& model_path, const std::string& io_path) {
  auto model = cnn();
  lockstep::load_safetensors(model, model_path);
  model->eval();
  const auto io = lockstep::read_safetensors(io_path);
  const double diff = (model->forward(io["x"]) - io["y"]).abs().max().item<double>();
  std::cout << "cnn-check: largest difference " << diff << "\n";
  return diff <= 1e-6 ? 0 : 1;
}

// The model of tests/python/dcp_interop.py, its BatchNorm statistics moved.
torch::nn::Sequential dcp_model() {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::BatchNorm1d(7), torch::nn::Linear(7, 3));
  model->forward(torch::randn({6, 5}));
  return model;
}

// fn(rank's group, rank) on `world` threads; false if any threw (said on stderr).
bool on_ranks(int world, const std::function<void(lockstep::ProcessGroup&)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::atomic<bool> ok{true};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto group = lockstep::new_group(store, rank, world);
        fn(group);
      } catch (const std::exception& e) {
        std::cerr << "rank " << rank << ": " << e.what() << "\n";
        ok = false;
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  return ok;
}

// Adam's state of the wrapped module's parameters under PyTorch's names
// (state.<name>.exp_avg, .exp_avg_sq, .step), gathered from every rank.
void add_full_adam_state(lockstep::FullyShardedDataParallel<torch::nn::Sequential>& model, torch::optim::Adam& adam,
                         torch::OrderedDict<std::string, torch::Tensor>& into) {
  torch::optim::Adam full(model->module()->parameters());
  lockstep::full_optimizer_state(model, adam, full);
  for (const auto& item : model->module()->named_parameters()) {
    const auto key = lockstep::detail::optimizer_state_key(full.state(), item.value());
    const auto& state = static_cast<const torch::optim::AdamParamState&>(*full.state().at(key));
    into.insert("state." + item.key() + ".exp_avg", state.exp_avg().clone());
    into.insert("state." + item.key() + ".exp_avg_sq", state.exp_avg_sq().clone());
    into.insert("state." + item.key() + ".step", torch::tensor(state.step(), torch::kLong));
  }
}

// The model after one Adam step, saved with its optimizer's state; REF:
// its parameters, buffers and Adam's state, whole.
int fsdp_save_dcp(const std::string& dir, int world, const std::string& ref) {
  auto bare = dcp_model();
  const auto input = torch::randn({6, 5});
  // A copy per rank, made here: ranks that each seeded and built one would
  // share the global generator, and rank 0's could differ from REF.
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < world; ++r) {
    nets.emplace_back(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(bare->clone()));
  }
  return on_ranks(world, [&](lockstep::ProcessGroup& group) {
    lockstep::FullyShardedDataParallel<torch::nn::Sequential> model(nets[group.rank()], group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    model(input).pow(2).sum().backward();
    adam.step();
    lockstep::save_sharded(model, adam, dir);
    torch::OrderedDict<std::string, torch::Tensor> whole;
    add_full_adam_state(model, adam, whole);
    auto full = model->summon_full_params();
    for (const auto& list : {model->module()->named_parameters(), model->module()->named_buffers()}) {
      for (const auto& item : list) {
        whole.insert(item.key(), item.value().detach().clone());
      }
    }
    if (group.rank() == 0) {
      lockstep::write_safetensors(whole, ref);
    }
  }) ? 0 : 1;
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
      std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// Loads DIR with Adam at WORLD ranks; every parameter, buffer and state
// tensor that REF holds must be its bitwise (a step count: its number).
int fsdp_load_dcp(const std::string& dir, int world, const std::string& ref) {
  const auto expected = lockstep::read_safetensors(ref);
  std::atomic<int> mismatches{0};
  std::atomic<int> compared{0};
  const bool ran = on_ranks(world, [&](lockstep::ProcessGroup& group) {
    lockstep::FullyShardedDataParallel<torch::nn::Sequential> model(torch::nn::Sequential(
        torch::nn::Linear(5, 7), torch::nn::BatchNorm1d(7), torch::nn::Linear(7, 3)), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.5));
    lockstep::load_sharded(model, adam, dir);
    torch::OrderedDict<std::string, torch::Tensor> loaded;
    add_full_adam_state(model, adam, loaded);
    auto full = model->summon_full_params();
    for (const auto& list : {model->module()->named_parameters(), model->module()->named_buffers()}) {
      for (const auto& item : list) {
        loaded.insert(item.key(), item.value());
      }
    }
    for (const auto& item : loaded) {
      const auto* want = expected.find(item.key());
      if (want == nullptr) {
        std::cerr << "rank " << group.rank() << ": " << ref << " has no " << item.key() << "\n";
        ++mismatches;
      } else if (item.key().size() > 5 && item.key().compare(item.key().size() - 5, 5, ".step") == 0
                     ? want->item<double>() != item.value().item<double>()
                     : !same_bits(*want, item.value())) {
        std::cerr << "rank " << group.rank() << ": " << item.key() << " differs from " << ref << "\n";
        ++mismatches;
      }
      ++compared;
    }
  });
  std::cout << "fsdp-load-dcp: " << (ran && mismatches == 0 ? "every rank's parameters, buffers and Adam state are "
                                                               "REF's bitwise" : "FAILED")
            << " (" << compared << " tensors compared)\n";
  return ran && mismatches == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 2 && args[0] == "write-patterns") {
      return write_patterns(args[1]);
    }
    if (args.size() == 2 && args[0] == "check-patterns") {
      return check_patterns(args[1]);
    }
    if (args.size() == 3 && args[0] == "cnn-save") {
      return cnn_save(args[1], args[2]);
    }
    if (args.size() == 3 && args[0] == "cnn-check") {
      return cnn_check(args[1], args[2]);
    }
    if (args.size() == 4 && args[0] == "fsdp-save-dcp") {
      return fsdp_save_dcp(args[1], std::stoi(args[2]), args[3]);
    }
    if (args.size() == 4 && args[0] == "fsdp-load-dcp") {
      return fsdp_load_dcp(args[1], std::stoi(args[2]), args[3]);
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: lockstep_safetensors_interop write-patterns|check-patterns FILE, cnn-save|cnn-check MODEL IO, "
               "or fsdp-save-dcp|fsdp-load-dcp DIR WORLD REF\n";
  return 2;
}
