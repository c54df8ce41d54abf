#include <lockstep/scatter_gather.h>

#include <ATen/WrapDimUtils.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace lockstep {

namespace {
// More replicas than any machine has devices: a larger count is a mistake,
// and the split's vectors would not fit in memory.
constexpr int64_t kMaxReplicas = int64_t{1} << 16;
// The largest row count a double holds exactly, so that each share is exact to a row.
constexpr int64_t kMaxBatch = int64_t{1} << 53;
} // namespace

std::vector<int64_t> chunk_sizes(int64_t batch, int64_t replicas, const std::vector<double>& weights) {
  TORCH_CHECK(replicas > 0, "lockstep::chunk_sizes: expected at least one replica, but got ", replicas, ".");
  TORCH_CHECK(batch >= 0 && batch <= kMaxBatch, "lockstep::chunk_sizes: expected a batch size from 0 to ", kMaxBatch,
              ", but got ", batch, ".");
  TORCH_CHECK(replicas <= kMaxReplicas, "lockstep::chunk_sizes: ", replicas, " replicas is more than the ", kMaxReplicas,
              " it splits a batch between; expected one per device.");
  TORCH_CHECK(
      weights.empty() || static_cast<int64_t>(weights.size()) == replicas,
      "lockstep::DataParallel: weights has ", weights.size(), " entries but there are ", replicas,
      " devices; give one weight per device, or none for an even split.");
  std::vector<double> w = weights.empty() ? std::vector<double>(replicas, 1.0) : weights;
  for (size_t i = 0; i < w.size(); ++i) {
    TORCH_CHECK(
        std::isfinite(w[i]) && w[i] > 0,
        "lockstep::DataParallel: weights[", i, "] is ", w[i],
        "; every weight must be a finite number > 0 (leave a device out of devices() instead of giving it 0).");
  }
  // Shares from the weights scaled by the largest: their sum cannot overflow
  // to infinity however large the weights, and each share is at most 1, so
  // that batch * share never exceeds the batch.
  const double largest = *std::max_element(w.begin(), w.end());
  for (auto& x : w) {
    x /= largest;
  }
  const double total = std::accumulate(w.begin(), w.end(), 0.0);

  // Largest remainder: floors first, then one more row to the largest
  // fractional parts, lower index first on ties.
  std::vector<int64_t> sizes(replicas);
  std::vector<std::pair<double, int64_t>> remainders(replicas);
  int64_t assigned = 0;
  for (int64_t i = 0; i < replicas; ++i) {
    const double exact = static_cast<double>(batch) * (w[i] / total);
    // Rounding can push a floor one row past the exact share: never hand out more than the batch.
    sizes[i] = std::min<int64_t>(batch - assigned, static_cast<int64_t>(std::floor(exact)));
    remainders[i] = {exact - static_cast<double>(sizes[i]), i};
    assigned += sizes[i];
  }
  std::stable_sort(remainders.begin(), remainders.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int64_t k = 0; assigned < batch; k = (k + 1) % replicas) {
    ++sizes[remainders[k].second];
    ++assigned;
  }
  TORCH_INTERNAL_ASSERT(assigned == batch);
  return sizes;
}

namespace detail {

std::string format_path(const Path& path) {
  TORCH_INTERNAL_ASSERT(!path.empty());
  std::string text = "argument ";
  text += std::to_string(path[0].index);
  for (size_t i = 1; i < path.size(); ++i) {
    text += '[';
    if (path[i].key != nullptr) {
      text += '"';
      text += *path[i].key;
      text += '"';
    } else {
      text += std::to_string(path[i].index);
    }
    text += ']';
  }
  return text;
}

void SplitSites::add(const torch::Tensor& tensor, c10::optional<int64_t> dim, const Path& path) {
  if (!tensor.defined()) {
    return; // an absent optional input: passed through as is
  }
  SplitSite site;
  site.ndim = tensor.dim();
  site.dim = dim.value_or(default_dim);
  if (site.ndim > 0 && site.dim >= -site.ndim && site.dim < site.ndim) {
    site.dim = site.dim < 0 ? site.dim + site.ndim : site.dim;
    site.size = tensor.size(site.dim);
    site.valid = true;
  }
  site.path = path;
  sites.push_back(std::move(site));
}

int64_t batch_size_of(const SplitSites& sites) {
  const auto& s = sites.sites;
  TORCH_CHECK(
      !s.empty(),
      "lockstep::DataParallel: no argument has a tensor to split along dim ", sites.default_dim,
      ", so there is no batch to divide between replicas. Pass the batch as a tensor (not wrapped in "
      "lockstep::broadcast), or call the module directly.");
  for (size_t i = 0; i < s.size(); ++i) {
    TORCH_CHECK(
        s[i].valid, "lockstep::DataParallel: ", format_path(s[i].path), " is a ", s[i].ndim,
        "-dim tensor and cannot be split along dim ", s[i].dim,
        ". Wrap it in lockstep::broadcast(...) to give every replica the whole tensor, or in "
        "lockstep::split(t, dim) to split it along another dimension.");
    if (s[i].size != s[0].size) {
      const auto where = format_path(s[i].path);
      TORCH_CHECK(
          false, "lockstep::DataParallel: ", format_path(s[0].path), " has size ", s[0].size, " along dim ", s[0].dim,
          " but ", where, " has size ", s[i].size, " along dim ", s[i].dim,
          "; every split tensor must have the same batch size. If ", where,
          " is meant for every replica whole (a shared batch-1 input, for example), pass it as "
          "lockstep::broadcast(tensor).");
    }
  }
  return s[0].size;
}

torch::Tensor ReplicaScatter::take(const torch::Tensor& tensor, c10::optional<int64_t> split_dim, bool whole) {
  if (!tensor.defined()) {
    return tensor;
  }
  if (identity) {
    return tensor.to(device);
  }
  int64_t d = 0;
  torch::Tensor piece = tensor;
  if (!whole) {
    d = c10::maybe_wrap_dim(split_dim.value_or(dim), tensor.dim());
    piece = tensor.narrow(d, offset, size);
  }
  piece = piece.to(device);
  if (whole && piece.is_same(tensor)) {
    shared.emplace_back(tensor, tensor._version());
  }
  if (track_grad && tensor.requires_grad()) {
    // The replica's graph starts at `piece`, where ParallelBackward takes its
    // gradient; a non-leaf made from `tensor` (not `tensor` itself, whose
    // hooks would run once per replica), so that a create_graph backward
    // reaches the caller's tensor (Note [Replica parameters] in
    // src/dp/data_parallel.cpp).
    if (piece.is_same(tensor)) {
      piece = tensor.view_as(tensor);
    }
    leaves->push_back(piece);
    if (sources != nullptr) {
      sources->push_back(InputSource{tensor, !whole, d});
    }
  }
  return piece;
}

void check_same_length(size_t expected, size_t got, size_t replica, const char* what) {
  TORCH_CHECK(
      expected == got, "lockstep::DataParallel: replica ", replica, " returned a ", what, " of ", got,
      " elements but replica 0 returned ", expected,
      "; every replica must return the same structure so outputs can be gathered element by element.");
}

void check_same_presence(bool expected, bool got, size_t replica) {
  TORCH_CHECK(
      expected == got, "lockstep::DataParallel: replica ", replica, " returned an optional that is ",
      got ? "set" : "empty", " but replica 0's is ", expected ? "set" : "empty",
      "; every replica must return the same structure so outputs can be gathered element by element.");
}

} // namespace detail
} // namespace lockstep
