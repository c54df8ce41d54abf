#pragma once

// Internal: safetensors files mapped for reading, written atomically, and
// matched against a module's state; shared by the whole-module functions
// (src/io/safetensors.cpp) and FullyShardedDataParallel's
// (src/fsdp/safetensors.cpp).

#include <lockstep/safetensors.h>

#include "io/safetensors_format.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// One safetensors file, mapped copy-on-write and checked.
struct SafetensorsFile {
  std::string path;
  std::shared_ptr<char> bytes; // the mapping; unmapped when the last tensor of it dies
  uint64_t size = 0;
  SafetensorsHeader header;

  /// Entry `i` as a CPU tensor over the mapping (a copy where the file
  /// leaves it misaligned for its dtype).
  torch::Tensor tensor(size_t i) const;
};

SafetensorsFile open_safetensors(const std::string& path);

/// The tensors behind a path that read_safetensors takes: one file, or the
/// files of an index, checked against it.
struct SafetensorsSet {
  std::vector<SafetensorsFile> files;
  struct Where {
    std::string name;
    size_t file;
    size_t entry;
  };
  std::vector<Where> tensors; // every name once, the index's order or the file's

  const SafetensorsEntry& entry(const Where& where) const {
    return files[where.file].header.entries[where.entry];
  }
};

SafetensorsSet open_safetensors_set(const std::string& path);

/// A tensor's values as the bytes a file holds: on the CPU, contiguous, and
/// with a conjugate or negative view resolved (such a view's memory holds
/// the values before the conjugation or negation).
torch::Tensor host_bytes(const torch::Tensor& tensor);
/// An error unless `tensor` has bytes to write: dense and not on the meta
/// device (a module built with deferred initialisation). `what` names it.
void check_has_bytes(const torch::Tensor& tensor, const std::string& what);

/// A tensor to write: its name, and a function giving its bytes (a
/// contiguous CPU tensor of `entry`'s dtype and shape) when its turn comes,
/// so that a writer need not hold them all at once.
struct SafetensorsSource {
  SafetensorsEntry entry;
  std::function<torch::Tensor()> bytes;
};

/// One file of a save: its header, and its sources in the order they are
/// written (safetensors_header's).
struct SafetensorsFilePlan {
  std::string path;
  std::string header;
  std::vector<size_t> order; // indices into the sources
};

/// The files a save writes: one at `path`; or, past
/// SafetensorsSaveOptions::max_shard_bytes, numbered files and an index
/// (Note [Safetensors save ids]).
struct SafetensorsSavePlan {
  std::vector<SafetensorsFilePlan> files;
  std::string index_path; // empty for one file
  std::string index;
  std::string superseded; // the other layout's file, removed once the save is whole
};

SafetensorsSavePlan plan_safetensors_save(const std::vector<SafetensorsSource>& sources, const std::string& path,
                                          const SafetensorsSaveOptions& options, const std::string& who);

/// Writes the plan's files (each atomically), then its index, then removes
/// what it supersedes. Each source's bytes() is called once, in the plan's
/// order.
void write_safetensors_save(const SafetensorsSavePlan& plan, const std::vector<SafetensorsSource>& sources,
                            const std::string& who);

/// Whether `text` ends with `suffix`.
bool ends_with(const std::string& text, const std::string& suffix);

/// {"format": "pt"} first, unless `metadata` has a format.
SafetensorsMetadata with_format(SafetensorsMetadata metadata);

/// What a load copies: each of the module's tensors that the file has.
struct StateMatch {
  std::vector<std::pair<size_t, const SafetensorsSet::Where*>> pairs; // (module tensor, file tensor)
};

/// Matches `names` (with `shapes` and `dtypes`) to `set`'s tensors as
/// safetensors' load_model does: missing and unexpected names are an error
/// when strict, a size mismatch always, a dtype mismatch unless
/// convert_dtypes; every error at once, naming `file`. `same_as[i]`, where
/// given, is the first name of the tensor that name i also is (a tied
/// parameter): a name missing from the file is not an error where another
/// name of its tensor is there (Note [Tied parameters in safetensors files]).
StateMatch match_state(const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
                       const std::vector<torch::ScalarType>& dtypes, const SafetensorsSet& set,
                       const SafetensorsLoadOptions& options, const std::string& file,
                       const std::vector<size_t>& same_as = {});

/// `set`'s tensor at `where` in `dtype` (the module's), converted where a
/// match allowed it (convert_dtypes): a value that does not survive the
/// conversion (a finite float made infinite, an integer that does not fit)
/// is an error naming the tensor and `file`.
torch::Tensor read_as(const SafetensorsSet& set, const SafetensorsSet::Where& where, torch::ScalarType dtype,
                      const std::string& file);

/// For each of `tensors`, the index of the first one that is the same view
/// of the same memory (itself where none is): a module's tied parameters.
std::vector<size_t> same_tensors(const std::vector<torch::Tensor>& tensors);

} // namespace detail
} // namespace lockstep
