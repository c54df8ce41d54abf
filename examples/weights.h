#pragma once

// lockstep-train's weights in and out as safetensors: --init-from, and the
// model.safetensors written beside model.pt, which Python reads
// (examples/python/evaluate.py).

#include "models.h"

#include <lockstep/safetensors.h>

#include <c10/util/Exception.h>

#include <fstream>
#include <string>

namespace lockstep {
namespace examples {

// One tensor --init-from loaded: every value finite, or an error naming it.
inline void check_finite_weight(const std::string& path, const std::string& name, const torch::Tensor& tensor) {
  if (!tensor.is_floating_point()) {
    return;
  }
  const int64_t bad = tensor.numel() - torch::isfinite(tensor).sum().item<int64_t>();
  TORCH_CHECK(bad == 0, "lockstep-train: --init-from ", path, ": ", name, " holds ", bad, " NaN or infinite value(s) of ",
              tensor.numel(), "; training from it would give NaN. Give weights saved from a run that did not diverge.");
}

// Why --init-from's `path` did not load, when a flag or a file beside it
// says more than the load's own error: the flag behind a shape
// (shape_flag_hint), or the .safetensors that lockstep-train wrote beside a
// .pt; "" otherwise.
inline std::string init_from_hint(TrainerNet& net, const std::string& path) {
  const std::string pt = ".pt";
  char magic[4] = {};
  const bool zip = std::ifstream(path, std::ios::binary).read(magic, 4) && std::string(magic, 4) == "PK\x03\x04";
  if (zip && path.size() > pt.size() && path.compare(path.size() - pt.size(), pt.size(), pt) == 0) {
    const std::string beside = path.substr(0, path.size() - pt.size()) + ".safetensors";
    if (std::ifstream(beside).good()) {
      return "--init-from reads safetensors, and " + path + " is torch::save's archive; give " + beside +
             ", which lockstep-train wrote beside it.";
    }
  }
  torch::OrderedDict<std::string, torch::Tensor> saved;
  try {
    saved = lockstep::read_safetensors(path);
  } catch (const c10::Error&) {
    return ""; // the load's own error says what is wrong with the file
  }
  for (const auto& [name, tensor] : net->named_parameters().pairs()) {
    if (const auto* there = saved.find(name)) {
      const std::string hint = shape_flag_hint(name, there->sizes(), tensor.sizes());
      if (!hint.empty()) {
        return hint;
      }
    }
  }
  return "";
}

/// --init-from: `path`'s weights into `net`, strictly, before any wrapper
/// copies rank 0's to the others. Nothing when `path` is empty.
inline void init_from(TrainerNet& net, const std::string& path) {
  if (path.empty()) {
    return;
  }
  try {
    lockstep::load_safetensors(net, path);
  } catch (const c10::Error& e) {
    const std::string hint = init_from_hint(net, path);
    TORCH_CHECK(hint.empty(), "lockstep-train: --init-from ", path, ": ", hint);
    TORCH_CHECK(false, "lockstep-train: --init-from ", path, ": ", e.what_without_backtrace(),
                "\nGive a safetensors file of this trainer's --model ", net->kind, " (a model.safetensors that "
                "lockstep-train wrote with --model ", net->kind, net->kind == "cnn" ? ", or Python's ConvNet state_dict "
                "from examples/python/evaluate.py saved with save_file" : "", ").");
  }
  // A NaN or an infinity would train to NaN, and the run would then blame --lr.
  for (const auto& [name, tensor] : net->named_parameters().pairs()) {
    check_finite_weight(path, name, tensor);
  }
  for (const auto& [name, tensor] : net->named_buffers().pairs()) {
    check_finite_weight(path, name, tensor);
  }
}

} // namespace examples
} // namespace lockstep
