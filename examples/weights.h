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
}

} // namespace examples
} // namespace lockstep
