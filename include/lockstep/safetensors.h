#pragma once

/// \file
/// Weights in and out of LibTorch in safetensors, the format of Hugging Face
/// and of Python's `safetensors` package: a model saved here loads in Python
/// with `model.load_state_dict(safetensors.torch.load_file(path))` (or
/// `load_model`, with strict=False for a model with tied weights), and a
/// Python `state_dict` saved with `save_file` or `save_model` loads into the
/// LibTorch module of the same architecture. Names are the module's state-dict names
/// (`body.0.weight`, `bn.running_mean`), which equal Python's.

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

/// String pairs of a file's `__metadata__`, in order.
using SafetensorsMetadata = std::vector<std::pair<std::string, std::string>>;

/// How save_safetensors writes.
class SafetensorsSaveOptions {
 public:
  /// Splits the model into files of at most about this many bytes
  /// (`model-00001-of-00003.safetensors`, ...) with an index beside them,
  /// `model.safetensors.index.json`, as Hugging Face's save_pretrained does;
  /// a tensor larger than the limit gets a file of its own. 0 (the default):
  /// one file, however large.
  SafetensorsSaveOptions& max_shard_bytes(int64_t bytes);
  /// The limit set, 0 for one file.
  int64_t max_shard_bytes() const {
    return max_shard_bytes_;
  }
  /// Pairs written to `__metadata__` besides `{"format": "pt"}`.
  SafetensorsSaveOptions& metadata(SafetensorsMetadata metadata);
  /// The pairs set.
  const SafetensorsMetadata& metadata() const {
    return metadata_;
  }

 private:
  int64_t max_shard_bytes_ = 0;
  SafetensorsMetadata metadata_;
};

/// How load_safetensors matches a file to a module.
class SafetensorsLoadOptions {
 public:
  /// Strict (the default): the file's names are exactly the module's, and
  /// any name missing or unexpected is an error listing them all, as
  /// Python's `load_state_dict(strict=True)`, except that a tensor the module
  /// holds under two names (tied weights) needs only one of them in the
  /// file, as safetensors' `load_model`: its `save_model` and Hugging Face's
  /// files keep one. Not strict: the names both have are loaded, the others
  /// left alone. Shapes must match either way.
  SafetensorsLoadOptions& strict(bool strict);
  /// Whether the load is strict.
  bool strict() const {
    return strict_;
  }
  /// A tensor whose dtype differs from the module's is an error unless this
  /// is on; then it is converted (bf16 weights into an fp32 model, say).
  SafetensorsLoadOptions& convert_dtypes(bool convert);
  /// Whether dtypes are converted.
  bool convert_dtypes() const {
    return convert_dtypes_;
  }

 private:
  bool strict_ = true;
  bool convert_dtypes_ = false;
};

/// The tensors of a safetensors file, by name in the file's order, on the
/// CPU. `path` is one file, or an index (`*.safetensors.index.json`, or a
/// `model.safetensors` that is absent beside its index) whose files are read
/// together. The file is mapped, not read whole: a tensor's pages are read
/// when it is used, and writing to a tensor never changes the file. A damaged
/// file is an error naming it and the tensor.
torch::OrderedDict<std::string, torch::Tensor> read_safetensors(const std::string& path);

/// The `__metadata__` of a safetensors file (of an index: of its first file).
SafetensorsMetadata read_safetensors_metadata(const std::string& path);

/// Writes `tensors` (any device; copied to the CPU) as one safetensors file,
/// with `metadata` and `{"format": "pt"}` in its `__metadata__`: to a
/// temporary file beside `path`, synced, then renamed, so that `path` is
/// always a whole file.
void write_safetensors(const torch::OrderedDict<std::string, torch::Tensor>& tensors, const std::string& path,
                       const SafetensorsMetadata& metadata = {});

/// Writes every parameter and buffer of `module` under its state-dict name
/// (a tied weight under each of its names, as `state_dict()` holds it).
/// A DataParallel or DistributedDataParallel writes its module's, under the
/// bare module's names. A DistributedDataParallel writes on rank 0 and
/// returns at once on the others, so every rank may call it, or rank 0
/// alone (save its `module()` to write on another rank). A
/// FullyShardedDataParallel is collective: every rank calls it with the same
/// path, the units are gathered one at a time (so the peak is one unit), and
/// rank 0 writes.
void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const SafetensorsSaveOptions& options = {});

/// Loads a file that read_safetensors reads into `module`'s parameters and
/// buffers. Every name, shape and dtype is checked before anything is
/// copied, so an error leaves the module as it was. A DataParallel or
/// DistributedDataParallel loads into its module. A FullyShardedDataParallel
/// is collective: each rank reads only the bytes of its own shards.
void load_safetensors(torch::nn::Module& module, const std::string& path, const SafetensorsLoadOptions& options = {});

/// save_safetensors of a module held by a ModuleHolder
/// (`Net net; lockstep::save_safetensors(net, path);`).
template <typename Impl>
void save_safetensors(const torch::nn::ModuleHolder<Impl>& module, const std::string& path,
                      const SafetensorsSaveOptions& options = {}) {
  save_safetensors(static_cast<const torch::nn::Module&>(*module), path, options);
}
/// load_safetensors into a module held by a ModuleHolder.
template <typename Impl>
void load_safetensors(const torch::nn::ModuleHolder<Impl>& module, const std::string& path,
                      const SafetensorsLoadOptions& options = {}) {
  load_safetensors(static_cast<torch::nn::Module&>(*module.ptr()), path, options);
}
/// save_safetensors of a module held by a shared_ptr.
template <typename Impl>
void save_safetensors(const std::shared_ptr<Impl>& module, const std::string& path,
                      const SafetensorsSaveOptions& options = {}) {
  save_safetensors(static_cast<const torch::nn::Module&>(*module), path, options);
}
/// load_safetensors into a module held by a shared_ptr.
template <typename Impl>
void load_safetensors(const std::shared_ptr<Impl>& module, const std::string& path,
                      const SafetensorsLoadOptions& options = {}) {
  load_safetensors(static_cast<torch::nn::Module&>(*module), path, options);
}

} // namespace lockstep
