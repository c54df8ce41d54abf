#pragma once

// lockstep-train's weights in and out as safetensors: --init-from, and the
// model.safetensors written beside model.pt, which Python reads
// (examples/python/evaluate.py).

#include "models.h"

#include <lockstep/safetensors.h>

#include <c10/util/Exception.h>

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

/// --init-from: `path`'s weights into `net`, strictly, before any wrapper
/// copies rank 0's to the others. Nothing when `path` is empty.
inline void init_from(TrainerNet& net, const std::string& path) {
  if (path.empty()) {
    return;
  }
  try {
    lockstep::load_safetensors(net, path);
  } catch (const c10::Error& e) {
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
