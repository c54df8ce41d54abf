#include <lockstep/safetensors.h>

#include <lockstep/detail/sharded_core.h>
#include <lockstep/detail/wrapper.h>

#include "io/safetensors_file.h"

#include <torch/utils.h>

namespace lockstep {

SafetensorsSaveOptions& SafetensorsSaveOptions::max_shard_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "SafetensorsSaveOptions::max_shard_bytes: ", bytes,
              " is negative; give a size in bytes, or 0 for one file.");
  max_shard_bytes_ = bytes;
  return *this;
}

SafetensorsSaveOptions& SafetensorsSaveOptions::metadata(SafetensorsMetadata metadata) {
  // A file's __metadata__ holds each key once: the last value would win.
  for (size_t i = 0; i < metadata.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK(metadata[j].first != metadata[i].first, "lockstep: the safetensors metadata has the key \"",
                  metadata[i].first, "\" twice (\"", metadata[j].second, "\" and \"", metadata[i].second, "\"); a "
                  "file's __metadata__ holds each key once: give it one value.");
    }
  }
  metadata_ = std::move(metadata);
  return *this;
}

SafetensorsLoadOptions& SafetensorsLoadOptions::strict(bool strict) {
  strict_ = strict;
  return *this;
}

SafetensorsLoadOptions& SafetensorsLoadOptions::convert_dtypes(bool convert) {
  convert_dtypes_ = convert;
  return *this;
}

namespace {

// The module whose state a wrapper of replicas saves: its wrapped one.
const torch::nn::Module& bare(const torch::nn::Module& module) {
  const auto* wrapper = dynamic_cast<const detail::ReplicaWrapperMark*>(&module);
  return wrapper == nullptr ? module : wrapper->wrapped_module();
}

// Parameters, then buffers, under their state-dict names.
std::vector<std::pair<std::string, torch::Tensor>> module_state(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> state;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    state.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    state.emplace_back(item.key(), item.value());
  }
  return state;
}

detail::SafetensorsSource source_of(const std::string& name, const torch::Tensor& tensor, const std::string& who) {
  TORCH_CHECK(tensor.defined(), who, ": tensor '", name, "' is undefined; safetensors holds only defined tensors.");
  detail::SafetensorsSource source;
  source.entry.name = name;
  source.entry.dtype = tensor.scalar_type();
  detail::safetensors_dtype_name(tensor.scalar_type(), who + ": tensor '" + name + "'");
  detail::check_has_bytes(tensor, who + ": tensor '" + name + "'");
  source.entry.shape = tensor.sizes().vec();
  source.bytes = [tensor] { return detail::host_bytes(tensor); };
  return source;
}

} // namespace

torch::OrderedDict<std::string, torch::Tensor> read_safetensors(const std::string& path) {
  const auto set = detail::open_safetensors_set(path);
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.reserve(set.tensors.size());
  for (const auto& where : set.tensors) {
    tensors.insert(where.name, set.files[where.file].tensor(where.entry));
  }
  return tensors;
}

SafetensorsMetadata read_safetensors_metadata(const std::string& path) {
  return detail::open_safetensors_set(path).files.at(0).header.metadata;
}

void write_safetensors(const torch::OrderedDict<std::string, torch::Tensor>& tensors, const std::string& path,
                       const SafetensorsMetadata& metadata) {
  const std::string who = "lockstep::write_safetensors(" + path + ")";
  std::vector<detail::SafetensorsSource> sources;
  for (const auto& item : tensors) {
    sources.push_back(source_of(item.key(), item.value(), who));
  }
  const auto plan = detail::plan_safetensors_save(sources, path, SafetensorsSaveOptions().metadata(metadata), who);
  TORCH_INTERNAL_ASSERT(plan.files.size() == 1);
  detail::write_safetensors_save({plan.files, "", "", ""}, sources, who);
}

void save_safetensors(const torch::nn::Module& module, const std::string& path, const SafetensorsSaveOptions& options) {
  if (const auto* sharded = dynamic_cast<const detail::ShardedWrapperMark*>(&module)) {
    sharded->sharded_core().save_safetensors(path, options);
    return;
  }
  const auto* wrapper = dynamic_cast<const detail::ReplicaWrapperMark*>(&module);
  if (wrapper != nullptr && !wrapper->writes_files()) { // Note [One writer of replicas]
    TORCH_WARN_ONCE("lockstep::save_safetensors(", path, ") of a DistributedDataParallel on a rank other than 0 "
                    "writes nothing: rank 0 writes the weights, which are the same on every rank. Wait for it "
                    "(a barrier) before reading the file elsewhere, or save its module() to write a file here.");
    return;
  }
  const std::string who = "lockstep::save_safetensors(" + path + ")";
  std::vector<detail::SafetensorsSource> sources;
  for (const auto& [name, tensor] : module_state(bare(module))) {
    sources.push_back(source_of(name, tensor, who));
  }
  detail::write_safetensors_save(detail::plan_safetensors_save(sources, path, options, who), sources, who);
}

void load_safetensors(torch::nn::Module& module, const std::string& path, const SafetensorsLoadOptions& options) {
  if (auto* sharded = dynamic_cast<detail::ShardedWrapperMark*>(&module)) {
    sharded->sharded_core().load_safetensors(path, options);
    return;
  }
  const auto state = module_state(bare(module));
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<torch::ScalarType> dtypes;
  std::vector<torch::Tensor> tensors;
  for (const auto& [name, tensor] : state) {
    // copy_ into a meta tensor keeps nothing, and would "load" without error.
    TORCH_CHECK(!tensor.is_meta(), "lockstep::load_safetensors(", path, "): '", name, "' is on the meta device, which "
                "holds no values, so the load would keep none: make the module on the CPU or a GPU, then load.");
    names.push_back(name);
    shapes.push_back(tensor.sizes().vec());
    dtypes.push_back(tensor.scalar_type());
    tensors.push_back(tensor);
  }
  const auto set = detail::open_safetensors_set(path);
  const auto match =
      detail::match_state(names, shapes, dtypes, set, options, path, detail::same_tensors(tensors));
  std::vector<torch::Tensor> loaded; // every one read and converted before any is copied: an error loads nothing
  for (const auto& [i, where] : match.pairs) {
    loaded.push_back(detail::read_as(set, *where, dtypes[i], path));
  }
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < match.pairs.size(); ++k) {
    state[match.pairs[k].first].second.copy_(loaded[k]);
  }
}

} // namespace lockstep
