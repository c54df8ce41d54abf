#pragma once

// Internal: walking a call's arguments and the replicas' outputs.
//
// Note [One list of walkable types]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Arguments are split on the way in and outputs gathered on the way out. Both
// directions walk values through one trait, Structure<T>, so they understand
// exactly the same containers: std::vector, std::array, std::tuple, std::pair,
// std::map<std::string, ...> and std::optional / c10::optional. Everything
// else is a leaf. A leaf must be something a replica can use as it is (a
// number, a string, an enum, a device) or something DataParallel knows how to
// cut (a tensor, lockstep::split, lockstep::broadcast). Any other type might
// hold tensors DataParallel cannot see: copying it to every replica would give
// each replica the whole batch and drop its gradient without a word. So it is
// a compile-time error that says what to do instead.

#include <torch/types.h>

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

// --- the containers both directions walk -------------------------------------

/// One step into a call's arguments: an argument's or element's index, or a
/// map key. Recorded per split tensor; words only an error.
struct PathStep {
  size_t index = 0;
  const std::string* key = nullptr; // points into the caller's map, alive for the call
};
using Path = std::vector<PathStep>;

/// "argument 1[2][\"mask\"]".
std::string format_path(const Path& path);

/// Throws: replica `replica`'s container has `got` elements, replica 0's `expected`.
void check_same_length(size_t expected, size_t got, size_t replica, const char* what);
/// Throws: replica `replica` returned an optional that is empty where replica 0's is not, or the reverse.
void check_same_presence(bool expected, bool got, size_t replica);

template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};
// c10::optional is std::optional from PyTorch 2.x on, and its own class before.
template <typename T>
struct is_c10_optional {
  template <typename U>
  static std::is_same<U, c10::optional<typename U::value_type>> test(int);
  template <typename U>
  static std::false_type test(...);
  static constexpr bool value = decltype(test<T>(0))::value && !is_optional<T>::value;
};

/// How to walk a value of type T: `for_each` visits its elements with their
/// path step, `map` builds the same container of other element types, `zip`
/// rebuilds it from one value per replica. Leaves have no specialisation.
template <typename T, typename = void>
struct Structure {
  static constexpr bool is_container = false;
};

template <typename T, typename A>
struct Structure<std::vector<T, A>> {
  static constexpr bool is_container = true;
  template <template <typename> class F>
  using rebind = std::vector<F<T>>;
  template <typename Fn>
  static void for_each(const std::vector<T, A>& v, Fn&& fn) {
    for (size_t i = 0; i < v.size(); ++i) {
      fn(v[i], PathStep{i});
    }
  }
  template <typename Out, typename Fn>
  static Out map(const std::vector<T, A>& v, Fn&& fn) {
    Out out;
    out.reserve(v.size());
    for (const auto& e : v) {
      out.push_back(fn(e));
    }
    return out;
  }
  template <typename Fn>
  static std::vector<T, A> zip(const std::vector<const std::vector<T, A>*>& all, Fn&& fn) {
    for (size_t r = 1; r < all.size(); ++r) {
      check_same_length(all[0]->size(), all[r]->size(), r, "std::vector");
    }
    std::vector<T, A> out;
    out.reserve(all[0]->size());
    std::vector<const T*> elements(all.size());
    for (size_t i = 0; i < all[0]->size(); ++i) {
      for (size_t r = 0; r < all.size(); ++r) {
        elements[r] = &(*all[r])[i];
      }
      out.push_back(fn(elements));
    }
    return out;
  }
};

template <typename T, size_t N>
struct Structure<std::array<T, N>> {
  static constexpr bool is_container = true;
  template <template <typename> class F>
  using rebind = std::array<F<T>, N>;
  template <typename Fn>
  static void for_each(const std::array<T, N>& a, Fn&& fn) {
    for (size_t i = 0; i < N; ++i) {
      fn(a[i], PathStep{i});
    }
  }
  template <typename Out, typename Fn>
  static Out map(const std::array<T, N>& a, Fn&& fn) {
    return map_each<Out>(a, fn, std::make_index_sequence<N>{});
  }
  template <typename Fn>
  static std::array<T, N> zip(const std::vector<const std::array<T, N>*>& all, Fn&& fn) {
    return zip_each(all, fn, std::make_index_sequence<N>{});
  }

 private:
  template <typename Out, typename Fn, size_t... I>
  static Out map_each(const std::array<T, N>& a, Fn& fn, std::index_sequence<I...>) {
    return Out{fn(a[I])...}; // braced: left to right, so leaves are recorded in order
  }
  template <size_t I, typename Fn>
  static T zip_one(const std::vector<const std::array<T, N>*>& all, Fn& fn) {
    std::vector<const T*> elements;
    for (const auto* a : all) {
      elements.push_back(&(*a)[I]);
    }
    return fn(elements);
  }
  template <typename Fn, size_t... I>
  static std::array<T, N> zip_each(const std::vector<const std::array<T, N>*>& all, Fn& fn, std::index_sequence<I...>) {
    return std::array<T, N>{zip_one<I>(all, fn)...};
  }
};

template <typename T>
struct Structure<std::map<std::string, T>> {
  static constexpr bool is_container = true;
  template <template <typename> class F>
  using rebind = std::map<std::string, F<T>>;
  template <typename Fn>
  static void for_each(const std::map<std::string, T>& m, Fn&& fn) {
    size_t i = 0;
    for (const auto& kv : m) {
      fn(kv.second, PathStep{i++, &kv.first});
    }
  }
  template <typename Out, typename Fn>
  static Out map(const std::map<std::string, T>& m, Fn&& fn) {
    Out out;
    for (const auto& kv : m) {
      out.emplace(kv.first, fn(kv.second));
    }
    return out;
  }
  template <typename Fn>
  static std::map<std::string, T> zip(const std::vector<const std::map<std::string, T>*>& all, Fn&& fn) {
    std::map<std::string, T> out;
    std::vector<const T*> elements(all.size());
    for (const auto& kv : *all[0]) {
      for (size_t r = 0; r < all.size(); ++r) {
        auto it = all[r]->find(kv.first);
        TORCH_CHECK(
            it != all[r]->end(), "lockstep::DataParallel: replica ", r, " returned a map without the key \"", kv.first,
            "\" that replica 0 returned; every replica must return the same keys.");
        elements[r] = &it->second;
      }
      out.emplace(kv.first, fn(elements));
    }
    for (size_t r = 1; r < all.size(); ++r) {
      check_same_length(all[0]->size(), all[r]->size(), r, "std::map");
    }
    return out;
  }
};

template <typename... Ts>
struct Structure<std::tuple<Ts...>> {
  static constexpr bool is_container = true;
  using T = std::tuple<Ts...>;
  template <template <typename> class F>
  using rebind = std::tuple<F<Ts>...>;
  template <typename Fn>
  static void for_each(const T& t, Fn&& fn) {
    for_each_index(t, fn, std::index_sequence_for<Ts...>{});
  }
  template <typename Out, typename Fn>
  static Out map(const T& t, Fn&& fn) {
    return map_each<Out>(t, fn, std::index_sequence_for<Ts...>{});
  }
  template <typename Fn>
  static T zip(const std::vector<const T*>& all, Fn&& fn) {
    return zip_each(all, fn, std::index_sequence_for<Ts...>{});
  }

 private:
  template <typename Fn, size_t... I>
  static void for_each_index(const T& t, Fn& fn, std::index_sequence<I...>) {
    (fn(std::get<I>(t), PathStep{I}), ...);
  }
  template <typename Out, typename Fn, size_t... I>
  static Out map_each(const T& t, Fn& fn, std::index_sequence<I...>) {
    return Out{fn(std::get<I>(t))...}; // braced: left to right
  }
  template <size_t I, typename Fn>
  static auto zip_one(const std::vector<const T*>& all, Fn& fn) {
    std::vector<const std::tuple_element_t<I, T>*> elements;
    for (const T* t : all) {
      elements.push_back(&std::get<I>(*t));
    }
    return fn(elements);
  }
  template <typename Fn, size_t... I>
  static T zip_each(const std::vector<const T*>& all, Fn& fn, std::index_sequence<I...>) {
    return T{zip_one<I>(all, fn)...}; // braced: left to right, the order of for_each
  }
};

template <typename A, typename B>
struct Structure<std::pair<A, B>> {
  static constexpr bool is_container = true;
  template <template <typename> class F>
  using rebind = std::pair<F<A>, F<B>>;
  template <typename Fn>
  static void for_each(const std::pair<A, B>& p, Fn&& fn) {
    fn(p.first, PathStep{0});
    fn(p.second, PathStep{1});
  }
  template <typename Out, typename Fn>
  static Out map(const std::pair<A, B>& p, Fn&& fn) {
    return Out{fn(p.first), fn(p.second)}; // braced: left to right
  }
  template <typename Fn>
  static std::pair<A, B> zip(const std::vector<const std::pair<A, B>*>& all, Fn&& fn) {
    std::vector<const A*> firsts;
    std::vector<const B*> seconds;
    for (const auto* p : all) {
      firsts.push_back(&p->first);
      seconds.push_back(&p->second);
    }
    return std::pair<A, B>{fn(firsts), fn(seconds)};
  }
};

template <typename O>
struct Structure<O, std::enable_if_t<is_optional<O>::value || is_c10_optional<O>::value>> {
  static constexpr bool is_container = true;
  using T = typename O::value_type;
  template <template <typename> class F>
  using rebind = std::conditional_t<is_optional<O>::value, std::optional<F<T>>, c10::optional<F<T>>>;
  template <typename Fn>
  static void for_each(const O& o, Fn&& fn) {
    if (o.has_value()) {
      fn(*o, PathStep{0});
    }
  }
  template <typename Out, typename Fn>
  static Out map(const O& o, Fn&& fn) {
    return o.has_value() ? Out(fn(*o)) : Out();
  }
  template <typename Fn>
  static O zip(const std::vector<const O*>& all, Fn&& fn) {
    for (size_t r = 1; r < all.size(); ++r) {
      check_same_presence(all[0]->has_value(), all[r]->has_value(), r);
    }
    if (!all[0]->has_value()) {
      return O();
    }
    std::vector<const T*> values;
    for (const auto* o : all) {
      values.push_back(&**o);
    }
    return O(fn(values));
  }
};

// --- leaves --------------------------------------------------------------------

/// Values a replica can use as they are and that cannot hold a tensor.
template <typename T>
struct is_plain_value
    : std::disjunction<
          std::is_arithmetic<T>,
          std::is_enum<T>,
          std::is_same<T, std::string>,
          std::is_same<T, std::string_view>,
          std::is_same<T, const char*>,
          std::is_same<T, std::nullptr_t>,
          std::is_same<T, std::nullopt_t>,
          std::is_same<T, c10::nullopt_t>,
          std::is_same<T, torch::Device>,
          std::is_same<T, c10::IntArrayRef>> {};

/// The one check of Note [One list of walkable types]. Instantiated by both
/// directions' leaf handling of a type that is not a tensor or a marker.
template <typename T>
struct PlainLeaf {
  static_assert(
      is_plain_value<T>::value,
      "lockstep::DataParallel cannot look inside this type, so it cannot tell whether it holds tensors to split, "
      "move or gather. It walks std::vector, std::array, std::tuple, std::pair, std::map<std::string, ...>, "
      "std::optional and c10::optional, down to tensors, numbers, strings, enums and torch::Device. Pass the "
      "tensors in one of those containers; or, for an argument every replica should receive unchanged, wrap it in "
      "lockstep::broadcast(value) (its tensors then get no gradient through DataParallel); or call the module "
      "directly.");
};

// --- scatter: an argument to one replica's share of it ---------------------------

/// One tensor that a call splits, found while walking the arguments.
struct SplitSite {
  int64_t size = 0; // along `dim`, when `dim` is valid
  int64_t dim = 0; // wrapped into [0, ndim)
  int64_t ndim = 0;
  bool valid = false; // false: a 0-dim tensor, or `dim` out of range
  Path path; // where it is among the arguments
};

/// The split tensors of one call, in argument order.
struct SplitSites {
  explicit SplitSites(int64_t default_dim) : default_dim(default_dim) {}
  int64_t default_dim;
  std::vector<SplitSite> sites;
  void add(const torch::Tensor& tensor, c10::optional<int64_t> dim, const Path& path);
};

/// Checks that all split tensors agree on the batch size and returns it.
/// Errors name the tensors by their path.
int64_t batch_size_of(const SplitSites& sites);

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
  // Whole tensors this replica received as the caller's own, with their
  // version then (Note [A broadcast tensor changed in forward]).
  std::vector<std::pair<torch::Tensor, int64_t>> shared;

  /// This replica's part of `tensor`: a chunk along `dim` (default: the call's
  /// dim), or all of it when `whole`.
  torch::Tensor take(const torch::Tensor& tensor, c10::optional<int64_t> dim, bool whole = false);
};

/// An argument leaf: what a replica receives for it, how its split tensors are
/// found (`visit`), and how one replica's share is taken (`apply`).
template <typename T>
struct ScatterLeaf : PlainLeaf<T> {
  using type = T;
  static void visit(const T&, SplitSites&, Path&) {}
  static T apply(const T& value, ReplicaScatter&) {
    return value;
  }
};

template <>
struct ScatterLeaf<torch::Tensor> {
  using type = torch::Tensor;
  static void visit(const torch::Tensor& t, SplitSites& sites, Path& path) {
    sites.add(t, c10::nullopt, path);
  }
  static torch::Tensor apply(const torch::Tensor& t, ReplicaScatter& replica) {
    return replica.take(t, c10::nullopt);
  }
};

template <>
struct ScatterLeaf<Split> {
  using type = torch::Tensor;
  static void visit(const Split& s, SplitSites& sites, Path& path) {
    sites.add(s.tensor, s.dim, path);
  }
  static torch::Tensor apply(const Split& s, ReplicaScatter& replica) {
    return replica.take(s.tensor, s.dim);
  }
};

template <>
struct ScatterLeaf<Broadcast> {
  using type = torch::Tensor;
  static void visit(const Broadcast&, SplitSites&, Path&) {}
  static torch::Tensor apply(const Broadcast& b, ReplicaScatter& replica) {
    return replica.take(b.tensor, c10::nullopt, /*whole=*/true);
  }
};

template <typename T>
struct ScatterLeaf<BroadcastValue<T>> {
  using type = T;
  static void visit(const BroadcastValue<T>&, SplitSites&, Path&) {}
  static T apply(const BroadcastValue<T>& b, ReplicaScatter&) {
    return b.value;
  }
};

template <typename T, bool = Structure<T>::is_container>
struct Scatter : ScatterLeaf<T> {};

/// What a replica's forward receives for an argument of type T.
template <typename T>
using scatter_t = typename Scatter<std::decay_t<T>>::type;

template <typename T>
struct Scatter<T, true> {
  using S = Structure<T>;
  using type = typename S::template rebind<scatter_t>;
  static void visit(const T& value, SplitSites& sites, Path& path) {
    S::for_each(value, [&](const auto& element, PathStep step) {
      path.push_back(step);
      Scatter<std::decay_t<decltype(element)>>::visit(element, sites, path);
      path.pop_back();
    });
  }
  static type apply(const T& value, ReplicaScatter& replica) {
    return S::template map<type>(
        value, [&](const auto& element) { return Scatter<std::decay_t<decltype(element)>>::apply(element, replica); });
  }
};

/// Walks every argument of a call in order; paths start with the argument's index.
template <typename... Args>
SplitSites find_split_sites(int64_t dim, const Args&... args) {
  SplitSites sites(dim);
  Path path;
  size_t index = 0;
  ((path.assign(1, PathStep{index++}), Scatter<std::decay_t<Args>>::visit(args, sites, path)), ...);
  return sites;
}

// --- gather: the replicas' outputs to one ----------------------------------------
// The outputs are flattened into tensor lists in one fixed order, gathered leaf
// by leaf, and the structure is rebuilt around them.

/// An output leaf: numbers and strings must agree across replicas and are
/// returned once.
template <typename T>
struct GatherLeaf : PlainLeaf<T> {
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
struct GatherLeaf<torch::Tensor> {
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

template <typename T, bool = Structure<T>::is_container>
struct Gather : GatherLeaf<T> {};

template <typename T>
struct Gather<T, true> {
  using S = Structure<T>;
  static void collect(const T& value, std::vector<torch::Tensor>& flat) {
    S::for_each(value, [&](const auto& element, PathStep) {
      Gather<std::decay_t<decltype(element)>>::collect(element, flat);
    });
  }
  static T rebuild(const std::vector<const T*>& outs, const std::vector<torch::Tensor>& gathered, size_t& next) {
    return S::zip(outs, [&](const auto& elements) {
      using E = std::remove_cv_t<std::remove_pointer_t<typename std::decay_t<decltype(elements)>::value_type>>;
      return Gather<E>::rebuild(elements, gathered, next);
    });
  }
};

} // namespace detail
} // namespace lockstep
