// The pure planning of FullyShardedDataParallel: which unit owns which
// parameter, and how a flat buffer splits over the ranks. No tensors, no
// threads: tests/test_sharding_plan.cpp checks it directly.

#include <lockstep/detail/sharded_core.h>

#include <c10/util/Exception.h>

namespace lockstep {
namespace detail {

namespace {

// Whether the parameter `name` (module path, a dot, its own name) lies in the
// submodule at `path`.
bool inside(const std::string& name, const std::string& path) {
  return name.size() > path.size() && name.compare(0, path.size(), path) == 0 && name[path.size()] == '.';
}

} // namespace

std::vector<size_t> assign_units(const std::vector<std::string>& names, const std::vector<std::string>& paths) {
  std::vector<size_t> units(names.size(), 0);
  for (size_t i = 0; i < names.size(); ++i) {
    size_t best_length = 0;
    for (size_t u = 0; u < paths.size(); ++u) {
      if (inside(names[i], paths[u]) && paths[u].size() >= best_length) {
        best_length = paths[u].size();
        units[i] = u + 1;
      }
    }
  }
  return units;
}

ShardLayout shard_layout(int64_t numel, int world) {
  TORCH_INTERNAL_ASSERT(numel >= 0 && world >= 1);
  ShardLayout layout;
  layout.numel = numel;
  layout.shard = (numel + world - 1) / world;
  layout.padded = layout.shard * world;
  return layout;
}

} // namespace detail
} // namespace lockstep
