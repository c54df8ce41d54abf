#include "comm/collective_fingerprint.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <string>

namespace lockstep {
namespace detail {

// Note [LOCKSTEP_DEBUG=detail]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LOCKSTEP_DEBUG=detail (read when a group is made) is a mode of the check
// (Note [Ranks agree before they send] in src/comm/collective_check.cpp), not
// an exchange of its own: each collective is still checked by one
// all_gather. In that mode the fingerprint also carries the collective's
// number in its group, counted in the order collectives are started (the
// numbers of the flight record and the desync report: Note [Flight
// recorder]), and the number of dimensions and the first kShownDims sizes of
// the backend's first tensor. A mismatch then names the number and the
// shapes: "LOCKSTEP_DEBUG=detail: ranks disagree on collective #1: rank 0
// runs allreduce (sum) of [4] Float but rank 1 runs allreduce (sum) of [5]
// Float". That compares little more than the default mode, which already
// hashes the caller's shapes: what the mode adds is a message that reads
// alongside the flight record.
//
// The detail fields are in every fingerprint, zero outside the mode, with one
// field for the mode itself: fingerprints keep one size, so ranks that differ
// in the setting meet in one exchange and fail naming it, where all_gathers
// of two sizes would abort the process inside Gloo.

// Note [Collective tags]
// ~~~~~~~~~~~~~~~~~~~~~~
// Sizes alone cannot tell two collectives of equal size apart. When
// FullyShardedDataParallel's units have equal sizes and one rank's forward
// reads them in another order than another rank's (a branch on the rank or
// on the data), each rank gathers a different unit at the same point: the
// sizes agree, and every rank silently receives the others' shards of
// another unit. SyncBatchNorm layers of equal width run in another order
// swap statistics the same way. So a caller that knows which collective it
// means (FSDP: the bucket; SyncBatchNorm: the layer's number) tags it, the
// tag joins the fingerprint, and ranks whose tags differ stop with an error
// instead. Untagged collectives carry 0; tags are not taken from `what`,
// which may name rank-specific things.
// Two wrapped models of one layout meet the same trap: one rank that runs
// their forwards or backwards in the other order sends each bucket against
// the other model's bucket of the same number and size. So each wrapper
// also has a number, rank 0's proposal taken by every rank at construction
// (the wrappers are made in one order on every rank, as their
// constructors' own collectives require), and its tags hold it beside the
// bucket or layer: model_tag, layer_tag. A SyncBatchNorm over another group
// than its wrapper's keeps its layer number alone: that group's ranks may
// hold wrappers over other groups, whose numbers differ.
// GradScaler's found-inf agreement is one allreduce of four floats for every
// optimizer, so two optimizers unscaled in another order on one rank would
// swap their verdicts: one rank skips the step whose gradient overflowed on
// another, and the replicas part for good. Its tag is a hash of the
// optimizer's parameters' shapes (optimizer_tag), which needs no exchange;
// two optimizers of one layout still share it.
thread_local int64_t current_tag = 0;
constexpr int64_t kModelTagStride = int64_t{1} << 20; // parts of a model: buckets, then layers
constexpr int64_t kFirstLayerPart = int64_t{1} << 19;
constexpr int64_t kFirstOptimizerTag = int64_t{1} << 62; // above every model's: model numbers stay under 2^42
constexpr int64_t kOptimizerTags = int64_t{1} << 40;

int64_t propose_model_number() {
  static std::atomic<int64_t> next{1};
  return next++;
}

int64_t model_tag(int64_t model, int64_t part) {
  TORCH_INTERNAL_ASSERT(part >= 0 && part < kFirstLayerPart, "a model's part out of range: ", part);
  return model * kModelTagStride + part;
}

int64_t layer_tag(int64_t model, int64_t layer) {
  TORCH_INTERNAL_ASSERT(layer > 0 && layer < kModelTagStride - kFirstLayerPart, "a layer out of range: ", layer);
  return model * kModelTagStride + kFirstLayerPart + layer;
}

CollectiveTag::CollectiveTag(int64_t tag) : previous_(current_tag) {
  current_tag = tag;
}

CollectiveTag::~CollectiveTag() {
  current_tag = previous_;
}

int64_t current_collective_tag() {
  return current_tag;
}

// Note [The caller's collective]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ProcessGroup packs a list into one flat tensor, sends a dtype the backend
// lacks as one of its width, and runs Avg as a Sum divided afterwards
// (Note [Average]), so the backend, and this check behind it, see less than
// the caller asked for. Two ranks that call allreduce({a[2], b[3]}) and
// allreduce({a[3], b[2]}), or Avg and Sum, or half and bfloat16, would agree
// on "a sum of 5 elements" and each get numbers that mean something else. So
// ProcessGroup describes the caller's call (CallerView) for the fingerprint:
// the reduction asked for, the caller's dtype, the number of tensors, and a
// hash of their shapes.
struct CallerCall {
  bool set = false;
  int64_t op = -1, dtype = -1, count = 0, layout = 0;
};
thread_local CallerCall current_call;

// FNV-1a over each tensor's dimensions, the same on every rank.
int64_t layout_of(const std::vector<torch::Tensor>& tensors) {
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](int64_t v) {
    hash = (hash ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  };
  for (const auto& t : tensors) {
    mix(t.dim());
    for (int64_t size : t.sizes()) {
      mix(size);
    }
  }
  return static_cast<int64_t>(hash >> 1);
}

int64_t optimizer_tag(const std::vector<torch::Tensor>& params) {
  return kFirstOptimizerTag + layout_of(params) % kOptimizerTags;
}

CallerView::CallerView(const std::vector<torch::Tensor>& tensors, int64_t op)
    : previous_{current_call.set, current_call.op, current_call.dtype, current_call.count, current_call.layout} {
  current_call.set = true;
  current_call.op = op;
  current_call.dtype = tensors.empty() ? -1 : static_cast<int64_t>(tensors[0].scalar_type());
  current_call.count = static_cast<int64_t>(tensors.size());
  current_call.layout = layout_of(tensors);
}

CallerView::~CallerView() {
  current_call = CallerCall{previous_.set, previous_.op, previous_.dtype, previous_.count, previous_.layout};
}

int64_t caller_reduction(int64_t reduction) {
  return current_call.set && current_call.op >= 0 ? current_call.op : reduction;
}

c10::ScalarType caller_dtype(c10::ScalarType dtype) {
  return current_call.set && current_call.dtype >= 0 ? static_cast<c10::ScalarType>(current_call.dtype) : dtype;
}

namespace fingerprint {

Fingerprint fingerprint_of(Kind kind, int64_t arg, const std::vector<torch::Tensor>& tensors) {
  Fingerprint f{};
  f[kKind] = kind;
  f[kArg] = arg;
  f[kDtype] = -1;
  f[kTag] = current_tag;
  f[kCount] = static_cast<int64_t>(tensors.size());
  f[kLayout] = layout_of(tensors);
  if (!tensors.empty()) {
    f[kDtype] = static_cast<int64_t>(tensors[0].scalar_type());
  }
  for (const auto& t : tensors) {
    f[kElements] += t.numel();
  }
  if (current_call.set) { // Note [The caller's collective]
    f[kArg] = current_call.op >= 0 ? current_call.op : arg;
    f[kDtype] = current_call.dtype;
    f[kCount] = current_call.count;
    f[kLayout] = current_call.layout;
  }
  return f;
}

// Note [LOCKSTEP_DEBUG=detail]: the mode's fields, from the tensors the
// backend gets.
void add_detail(Fingerprint& f, int64_t seq, const std::vector<torch::Tensor>& tensors) {
  f[kDetail] = 1;
  f[kSeq] = seq;
  if (!tensors.empty()) {
    f[kDims] = tensors[0].dim();
    for (int64_t d = 0; d < std::min<int64_t>(tensors[0].dim(), kShownDims); ++d) {
      f[kSizes + d] = tensors[0].size(d);
    }
  }
}

namespace {

// The sizes in describe(): "of 4 Float elements in 2 tensors", or under
// LOCKSTEP_DEBUG=detail the backend's shape, "of [4] Float (2 tensors, 4 elements)".
std::string sizes_of(const int64_t* f) {
  const std::string dtype = c10::toString(static_cast<c10::ScalarType>(f[kDtype]));
  std::ostringstream out;
  if (f[kDetail] == 0) {
    out << " of " << f[kElements] << " " << dtype << " elements";
    if (f[kCount] > 1) {
      out << " in " << f[kCount] << " tensors";
    }
    return out.str();
  }
  out << " of [";
  for (int64_t d = 0; d < std::min<int64_t>(f[kDims], kShownDims); ++d) {
    out << (d > 0 ? ", " : "") << f[kSizes + d];
  }
  out << (f[kDims] > static_cast<int64_t>(kShownDims) ? ", ...] " : "] ") << dtype;
  if (f[kCount] > 1) {
    out << " (" << f[kCount] << " tensors, " << f[kElements] << " elements)";
  }
  return out.str();
}

std::string describe(const int64_t* f) {
  static const char* kKinds[] = {"allreduce", "broadcast", "all_gather", "barrier", "reduce_scatter"};
  static const char* kReductions[] = {"sum", "avg", "max", "min"};
  const bool reduces = f[kKind] == kAllreduce || f[kKind] == kReduceScatter;
  if (f[kKind] < kAllreduce || f[kKind] > kReduceScatter || (reduces && (f[kArg] < 0 || f[kArg] > 3)) ||
      f[kDtype] < -1 || f[kDtype] >= static_cast<int64_t>(c10::ScalarType::NumOptions) || f[kDims] < 0) {
    return "a collective lockstep does not know";
  }
  std::ostringstream out;
  out << kKinds[f[kKind]];
  if (reduces) {
    out << " (" << kReductions[f[kArg]] << ")";
  } else if (f[kKind] == kBroadcast) {
    out << " from rank " << f[kArg];
  }
  if (f[kKind] != kBarrier) {
    out << sizes_of(f);
  }
  if (f[kTag] >= kFirstOptimizerTag) {
    out << " for the optimizer whose parameters' shapes hash to " << std::hex << f[kTag] - kFirstOptimizerTag;
    return out.str();
  }
  const int64_t part = f[kTag] % kModelTagStride, model = f[kTag] / kModelTagStride;
  if (part >= kFirstLayerPart) {
    out << " tagged layer " << part - kFirstLayerPart;
  } else if (part != 0) {
    out << " tagged " << part;
  }
  if (model != 0) {
    out << " of wrapped model " << model;
  }
  return out.str();
}

// What two fingerprints that differ differ in, beyond what describe() shows.
std::string difference_hint(const int64_t* a, const int64_t* b) {
  bool same = true, only_tags = true, only_shapes = true;
  for (size_t i = 0; i < kDetail; ++i) { // the detail fields follow from these, or are shown
    same = same && a[i] == b[i];
    only_tags = only_tags && (a[i] == b[i] || i == kTag);
    only_shapes = only_shapes && (a[i] == b[i] || i == kLayout);
  }
  if (same) {
    return "";
  }
  if (only_tags) {
    return " (the same sizes, but another collective: Note [Collective tags]; under FullyShardedDataParallel, a "
           "forward that reads its units in another order on some rank; with SyncBatchNorm, layers run in another "
           "order on some rank; two wrapped models run in another order on some rank; or, for GradScaler, optimizers "
           "unscaled in another order on some rank)";
  }
  if (only_shapes) {
    return " (as many elements, but in tensors of other shapes: a list split differently, or a tensor reshaped, on "
           "some rank; their elements would be matched by position and mean other things)";
  }
  return "";
}

} // namespace

// The error every rank throws when rank `r`'s fingerprint differs from rank
// 0's: each builds it from the same gathered fingerprints, so all say the same.
std::string disagreement(const int64_t* reference, const int64_t* theirs, int r) {
  const std::string other = "rank " + std::to_string(r);
  if (reference[kDetail] != theirs[kDetail]) { // Note [LOCKSTEP_DEBUG=detail]
    auto mode = [](const int64_t* f) { return f[kDetail] == 1 ? "LOCKSTEP_DEBUG=detail" : "LOCKSTEP_DEBUG off"; };
    return "ranks disagree on LOCKSTEP_DEBUG, so none of them sent this collective: rank 0 runs with " +
           std::string(mode(reference)) + " but " + other + " with " + mode(theirs) +
           ". Set it alike on every rank: detail or off.";
  }
  const bool detail = reference[kDetail] == 1;
  const std::string runs = "rank 0 runs " + describe(reference) + " but " + other + " runs " + describe(theirs);
  std::string text = detail ? "LOCKSTEP_DEBUG=detail: ranks disagree on collective #" + std::to_string(reference[kSeq]) +
                                  ": " + runs
                            : "ranks disagree on this collective, so none of them sent it: " + runs;
  if (detail && theirs[kSeq] != reference[kSeq]) {
    text += " as its collective #" + std::to_string(theirs[kSeq]);
  }
  text += difference_hint(reference, theirs);
  text += detail ? ", so none of them sent it. " : ". ";
  text += "Every rank must call the same collectives in the same order, with tensors of the same sizes and dtypes: "
          "look for a branch, a batch, a model or DistributedOptions (bucket_cap_mb) that differ between ranks.";
  if (!detail) {
    text += " LOCKSTEP_DEBUG=detail also numbers the collectives and names their shapes.";
  }
  return text;
}

} // namespace fingerprint
} // namespace detail
} // namespace lockstep
