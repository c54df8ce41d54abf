#pragma once

// Cutting a call's arguments into per-replica chunks and putting the
// replicas' outputs back together. The pure parts (chunk sizes, which tensors
// are split, how nested values are walked) are here so they can be tested
// without threads or replicas. See Note [DataParallel step] in
// data_parallel.h for where they sit in a training step.

#include <torch/types.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

/// A tensor that every replica receives whole instead of a chunk of it: a
/// shared batch-1 input, a lookup table, a mask. Its gradient is the sum of
/// the replicas' gradients. Make one with `lockstep::broadcast(t)`.
struct Broadcast {
  torch::Tensor tensor;
};

/// A tensor split along its own dimension instead of DataParallel's `dim`.
/// Make one with `lockstep::split(t, dim)`.
struct Split {
  torch::Tensor tensor;
  int64_t dim;
};

/// Marks `tensor` to be passed whole to every replica.
inline Broadcast broadcast(torch::Tensor tensor) {
  return Broadcast{std::move(tensor)};
}

/// Marks `tensor` to be split along `dim` (negative counts from the end).
inline Split split(torch::Tensor tensor, int64_t dim) {
  return Split{std::move(tensor), dim};
}

/// How 0-dim outputs (losses, metrics) of the replicas are combined.
enum class ScalarGather {
  /// A 1-D tensor with one entry per replica that ran, as PyTorch does.
  Stack,
  /// The replicas' values weighted by their share of the batch: for a
  /// mean-reduced loss, exactly the single-device value.
  Mean,
  /// The plain sum of the replicas' values.
  Sum,
};

/// Splits `batch` rows between `replicas` as evenly as possible, or in
/// proportion to `weights` (one positive weight per replica) when given.
/// Uses largest remainders, so sizes sum to `batch` and differ from the exact
/// share by less than one row; ties go to the lower index. A replica may get
/// 0 rows when `batch` is smaller than the number of replicas.
std::vector<int64_t> chunk_sizes(
    int64_t batch,
    int64_t replicas,
    const std::vector<double>& weights = {});

namespace detail {

/// One tensor that a call splits, found while walking the arguments.
struct SplitSite {
  int64_t size = 0; // along `dim`, when `dim` is valid
  int64_t dim = 0; // wrapped into [0, ndim)
  int64_t ndim = 0;
  bool valid = false; // false: a 0-dim tensor, or `dim` out of range
  std::string where; // "argument 1[2]"; only filled by a naming walk
};

/// Collects the split tensors of one call. Paths are only built when
/// `naming` is set: the fast walk leaves them empty, and a second, naming walk
/// runs only to word an error.
struct SplitSites {
  explicit SplitSites(int64_t default_dim, bool naming = false)
      : default_dim(default_dim), naming(naming) {}
  int64_t default_dim;
  bool naming;
  std::vector<SplitSite> sites;
  void add(const torch::Tensor& tensor, c10::optional<int64_t> dim, const std::string& where);
};

/// Checks that all split tensors agree on the batch size and returns it.
/// `names` re-walks the arguments with paths, for the error message only.
int64_t batch_size_of(const SplitSites& sites, const std::function<SplitSites()>& names);

/// What an input tensor becomes on each replica, and how its gradient comes
/// back: chunks concatenate, broadcast copies sum.
struct InputSource {
  torch::Tensor tensor;
  bool split = true;
  int64_t dim = 0;
};

/// One replica's view of a call: its rows and device, and the input leaves
/// whose gradients the backward pass must return.
struct ReplicaScatter {
  torch::Device device{torch::kCPU};
  int64_t dim = 0;
  int64_t offset = 0;
  int64_t size = 0;
  bool identity = false; // one replica: tensors pass through, moved to `device`
  bool track_grad = false; // inputs needing grad become leaves of the replica's graph
  std::vector<torch::Tensor>* leaves = nullptr;
  std::vector<InputSource>* sources = nullptr; // filled by the first replica only

  /// This replica's part of `tensor`: a chunk along `dim` (default: the call's
  /// dim), or all of it when `whole`.
  torch::Tensor take(const torch::Tensor& tensor, c10::optional<int64_t> dim, bool whole = false);
};

inline std::string element_path(const std::string& parent, const std::string& index) {
  return parent + "[" + index + "]";
}

/// Maps an argument type to what a replica receives and walks its tensors.
/// Anything not listed is passed to every replica unchanged (a copy).
template <typename T, typename = void>
struct Scatter {
  using type = T;
  static void visit(const T&, SplitSites&, const std::string&) {}
  static T apply(const T& value, ReplicaScatter&) {
    return value;
  }
};

template <>
struct Scatter<torch::Tensor> {
  using type = torch::Tensor;
  static void visit(const torch::Tensor& t, SplitSites& sites, const std::string& where) {
    sites.add(t, c10::nullopt, where);
  }
  static torch::Tensor apply(const torch::Tensor& t, ReplicaScatter& replica) {
    return replica.take(t, c10::nullopt);
  }
};

template <>
struct Scatter<Split> {
  using type = torch::Tensor;
  static void visit(const Split& s, SplitSites& sites, const std::string& where) {
    sites.add(s.tensor, s.dim, where);
  }
  static torch::Tensor apply(const Split& s, ReplicaScatter& replica) {
    return replica.take(s.tensor, s.dim);
  }
};

template <>
struct Scatter<Broadcast> {
  using type = torch::Tensor;
  static void visit(const Broadcast&, SplitSites&, const std::string&) {}
  static torch::Tensor apply(const Broadcast& b, ReplicaScatter& replica);
};

template <typename T>
struct Scatter<std::vector<T>> {
  using Inner = Scatter<std::decay_t<T>>;
  using type = std::vector<typename Inner::type>;
  static void visit(const std::vector<T>& v, SplitSites& sites, const std::string& where) {
    for (size_t i = 0; i < v.size(); ++i) {
      Inner::visit(v[i], sites, sites.naming ? element_path(where, std::to_string(i)) : where);
    }
  }
  static type apply(const std::vector<T>& v, ReplicaScatter& replica) {
    type out;
    out.reserve(v.size());
    for (const auto& e : v) {
      out.push_back(Inner::apply(e, replica));
    }
    return out;
  }
};

template <typename T>
struct Scatter<std::map<std::string, T>> {
  using Inner = Scatter<std::decay_t<T>>;
  using type = std::map<std::string, typename Inner::type>;
  static void visit(const std::map<std::string, T>& m, SplitSites& sites, const std::string& where) {
    for (const auto& kv : m) {
      Inner::visit(kv.second, sites, sites.naming ? element_path(where, "\"" + kv.first + "\"") : where);
    }
  }
  static type apply(const std::map<std::string, T>& m, ReplicaScatter& replica) {
    type out;
    for (const auto& kv : m) {
      out.emplace(kv.first, Inner::apply(kv.second, replica));
    }
    return out;
  }
};

template <typename... Ts>
struct Scatter<std::tuple<Ts...>> {
  using type = std::tuple<typename Scatter<std::decay_t<Ts>>::type...>;
  static void visit(const std::tuple<Ts...>& t, SplitSites& sites, const std::string& where) {
    visit_each(t, sites, where, std::index_sequence_for<Ts...>{});
  }
  static type apply(const std::tuple<Ts...>& t, ReplicaScatter& replica) {
    return apply_each(t, replica, std::index_sequence_for<Ts...>{});
  }

 private:
  template <size_t... I>
  static void visit_each(const std::tuple<Ts...>& t, SplitSites& sites, const std::string& where, std::index_sequence<I...>) {
    (Scatter<std::decay_t<Ts>>::visit(
         std::get<I>(t), sites, sites.naming ? element_path(where, std::to_string(I)) : where),
     ...);
  }
  template <size_t... I>
  static type apply_each(const std::tuple<Ts...>& t, ReplicaScatter& replica, std::index_sequence<I...>) {
    // Braced initialisation runs left to right, so every replica records its
    // input leaves in the same order.
    return type{Scatter<std::decay_t<Ts>>::apply(std::get<I>(t), replica)...};
  }
};

template <typename T>
using scatter_t = typename Scatter<std::decay_t<T>>::type;

/// Walks every argument of a call in order, with "argument N" paths.
template <typename... Args>
SplitSites find_split_sites(int64_t dim, bool naming, const Args&... args) {
  SplitSites sites(dim, naming);
  size_t index = 0;
  (Scatter<std::decay_t<Args>>::visit(
       args, sites, naming ? "argument " + std::to_string(index++) : std::string()),
   ...);
  return sites;
}

// ---------------------------------------------------------------------------
// Gather: the replicas' outputs are flattened into tensor lists in one fixed
// order, gathered leaf by leaf, and the structure is rebuilt around them.

/// Flattens and rebuilds an output type. Tensors are gathered; numbers and
/// strings must agree across replicas (they are returned once); containers are
/// walked element by element and must have the same shape on every replica.
template <typename T, typename = void>
struct Gather {
  static_assert(
      std::is_arithmetic<T>::value || std::is_same<T, std::string>::value,
      "lockstep::DataParallel can gather tensors, numbers, strings, and std::vector, "
      "std::tuple, std::pair and std::map<std::string, ...> of them. Return one of those "
      "from forward(), or call the module directly for other output types.");
  static void collect(const T&, std::vector<torch::Tensor>&) {}
  static T rebuild(const std::vector<const T*>& outs, const std::vector<torch::Tensor>&, size_t&) {
    for (size_t r = 1; r < outs.size(); ++r) {
      TORCH_CHECK(
          *outs[r] == *outs[0],
          "lockstep::DataParallel: replicas returned different values for a non-tensor output "
          "(replica 0 vs replica ", r, "). Only tensors are gathered; return this value as a "
          "tensor to have it concatenated, or make it the same on every replica.");
    }
    return *outs[0];
  }
};

template <>
struct Gather<torch::Tensor> {
  static void collect(const torch::Tensor& t, std::vector<torch::Tensor>& flat) {
    flat.push_back(t);
  }
  static torch::Tensor rebuild(
      const std::vector<const torch::Tensor*>&,
      const std::vector<torch::Tensor>& gathered,
      size_t& next) {
    TORCH_INTERNAL_ASSERT(next < gathered.size());
    return gathered[next++];
  }
};

void check_same_length(size_t expected, size_t got, size_t replica, const char* what);

template <typename T>
struct Gather<std::vector<T>> {
  static void collect(const std::vector<T>& v, std::vector<torch::Tensor>& flat) {
    for (const auto& e : v) {
      Gather<T>::collect(e, flat);
    }
  }
  static std::vector<T> rebuild(
      const std::vector<const std::vector<T>*>& outs,
      const std::vector<torch::Tensor>& gathered,
      size_t& next) {
    for (size_t r = 1; r < outs.size(); ++r) {
      check_same_length(outs[0]->size(), outs[r]->size(), r, "std::vector");
    }
    std::vector<T> result;
    result.reserve(outs[0]->size());
    std::vector<const T*> elems(outs.size());
    for (size_t i = 0; i < outs[0]->size(); ++i) {
      for (size_t r = 0; r < outs.size(); ++r) {
        elems[r] = &(*outs[r])[i];
      }
      result.push_back(Gather<T>::rebuild(elems, gathered, next));
    }
    return result;
  }
};

template <typename T>
struct Gather<std::map<std::string, T>> {
  static void collect(const std::map<std::string, T>& m, std::vector<torch::Tensor>& flat) {
    for (const auto& kv : m) {
      Gather<T>::collect(kv.second, flat);
    }
  }
  static std::map<std::string, T> rebuild(
      const std::vector<const std::map<std::string, T>*>& outs,
      const std::vector<torch::Tensor>& gathered,
      size_t& next) {
    std::map<std::string, T> result;
    std::vector<const T*> elems(outs.size());
    for (const auto& kv : *outs[0]) {
      for (size_t r = 0; r < outs.size(); ++r) {
        auto it = outs[r]->find(kv.first);
        TORCH_CHECK(
            it != outs[r]->end(),
            "lockstep::DataParallel: replica ", r, " returned a map without the key \"",
            kv.first, "\" that replica 0 returned; every replica must return the same keys.");
        elems[r] = &it->second;
      }
      result.emplace(kv.first, Gather<T>::rebuild(elems, gathered, next));
    }
    for (size_t r = 1; r < outs.size(); ++r) {
      check_same_length(outs[0]->size(), outs[r]->size(), r, "std::map");
    }
    return result;
  }
};

template <typename... Ts>
struct Gather<std::tuple<Ts...>> {
  using T = std::tuple<Ts...>;
  static void collect(const T& t, std::vector<torch::Tensor>& flat) {
    collect_each(t, flat, std::index_sequence_for<Ts...>{});
  }
  static T rebuild(const std::vector<const T*>& outs, const std::vector<torch::Tensor>& gathered, size_t& next) {
    return rebuild_each(outs, gathered, next, std::index_sequence_for<Ts...>{});
  }

 private:
  template <size_t... I>
  static void collect_each(const T& t, std::vector<torch::Tensor>& flat, std::index_sequence<I...>) {
    (Gather<std::decay_t<Ts>>::collect(std::get<I>(t), flat), ...);
  }
  template <size_t I>
  static auto rebuild_one(const std::vector<const T*>& outs, const std::vector<torch::Tensor>& gathered, size_t& next) {
    using E = std::decay_t<std::tuple_element_t<I, T>>;
    std::vector<const E*> elems;
    elems.reserve(outs.size());
    for (const T* o : outs) {
      elems.push_back(&std::get<I>(*o));
    }
    return Gather<E>::rebuild(elems, gathered, next);
  }
  template <size_t... I>
  static T rebuild_each(const std::vector<const T*>& outs, const std::vector<torch::Tensor>& gathered, size_t& next, std::index_sequence<I...>) {
    // Braced initialisation runs left to right, the order collect() used.
    return T{rebuild_one<I>(outs, gathered, next)...};
  }
};

template <typename A, typename B>
struct Gather<std::pair<A, B>> {
  using T = std::pair<A, B>;
  static void collect(const T& p, std::vector<torch::Tensor>& flat) {
    Gather<A>::collect(p.first, flat);
    Gather<B>::collect(p.second, flat);
  }
  static T rebuild(const std::vector<const T*>& outs, const std::vector<torch::Tensor>& gathered, size_t& next) {
    std::vector<const A*> firsts;
    std::vector<const B*> seconds;
    for (const T* o : outs) {
      firsts.push_back(&o->first);
      seconds.push_back(&o->second);
    }
    return T{Gather<A>::rebuild(firsts, gathered, next), Gather<B>::rebuild(seconds, gathered, next)};
  }
};

} // namespace detail
} // namespace lockstep
