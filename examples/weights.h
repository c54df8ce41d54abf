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

/// Where the safetensors copy of a model saved at `save_path` goes: `.pt`
/// replaced by `.safetensors`, or `.safetensors` added.
inline std::string safetensors_beside(const std::string& save_path) {
  const std::string pt = ".pt";
  const bool ends_in_pt = save_path.size() > pt.size() && save_path.compare(save_path.size() - pt.size(), pt.size(), pt) == 0;
  return (ends_in_pt ? save_path.substr(0, save_path.size() - pt.size()) : save_path) + ".safetensors";
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
                "\nGive a safetensors file of this trainer's CNN (a model.safetensors that lockstep-train wrote, or "
                "Python's ConvNet state_dict from examples/python/evaluate.py saved with save_file).");
  }
}

} // namespace examples
} // namespace lockstep
