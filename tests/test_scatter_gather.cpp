// The pure tests of DataParallel's splitting and joining: chunk sizes, the
// walk over nested arguments (scatter) and outputs (gather). No threads;
// they run in seconds.
#include <lockstep/scatter_gather.h>

#include "support/errors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <deque>
#include <map>
#include <numeric>
#include <optional>

namespace lockstep {
namespace {

using testing::error_of;

int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

TEST(ChunkSizes, EvenWhenDivisible) {
  EXPECT_EQ(chunk_sizes(8, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(chunk_sizes(9, 3), (std::vector<int64_t>{3, 3, 3}));
}

TEST(ChunkSizes, AsEvenAsPossibleWhenNot) {
  // PyTorch's chunk() would give 4, 4, 2.
  EXPECT_EQ(chunk_sizes(10, 3), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(chunk_sizes(11, 3), (std::vector<int64_t>{4, 4, 3}));
  for (int64_t batch = 1; batch < 40; ++batch) {
    for (int64_t n = 1; n < 7; ++n) {
      auto sizes = chunk_sizes(batch, n);
      EXPECT_EQ(sum(sizes), batch);
      auto [lo, hi] = std::minmax_element(sizes.begin(), sizes.end());
      EXPECT_LE(*hi - *lo, 1) << "batch " << batch << " over " << n;
    }
  }
}

TEST(ChunkSizes, SmallerBatchThanReplicasLeavesSomeEmpty) {
  EXPECT_EQ(chunk_sizes(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(chunk_sizes(0, 3), (std::vector<int64_t>{0, 0, 0}));
}

TEST(ChunkSizes, Weights) {
  EXPECT_EQ(chunk_sizes(8, 2, {3, 1}), (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(chunk_sizes(10, 2, {3, 1}), (std::vector<int64_t>{8, 2})); // 7.5/2.5: tie to the lower index
  EXPECT_EQ(chunk_sizes(1, 2, {1, 3}), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(chunk_sizes(100, 3, {0.5, 0.25, 0.25}), (std::vector<int64_t>{50, 25, 25}));
  for (int64_t batch = 0; batch < 50; ++batch) {
    auto sizes = chunk_sizes(batch, 3, {1.0, 2.5, 0.7});
    EXPECT_EQ(sum(sizes), batch);
    const double shares[] = {1.0 / 4.2, 2.5 / 4.2, 0.7 / 4.2};
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_LT(std::abs(sizes[i] - batch * shares[i]), 1.0);
    }
  }
}

// Found by fuzz_chunk_sizes: a replica count in the billions threw
// std::length_error from inside, weights near the largest double summed to
// infinity, which made every share NaN, and batches near 2^63 overflowed.
TEST(ChunkSizes, HugeReplicaCountsAndWeightsAreHandled) {
  EXPECT_ERROR_SAYS(chunk_sizes(8, int64_t{1} << 40),
                    "lockstep::chunk_sizes: 1099511627776 replicas is more than the 65536");
  EXPECT_EQ(chunk_sizes(10, 2, {1e308, 1e308}), (std::vector<int64_t>{5, 5}));
  EXPECT_ERROR_SAYS(chunk_sizes(int64_t{1} << 62, 2), "expected a batch size from 0 to 9007199254740992");
  const auto big = chunk_sizes(int64_t{1} << 53, 2, {1e308, 3e307});
  EXPECT_EQ(big[0] + big[1], int64_t{1} << 53);
  EXPECT_NEAR(static_cast<double>(big[0]) / static_cast<double>(big[1]), 10.0 / 3.0, 1e-9);
}

TEST(ChunkSizes, BadWeightsAreClearErrors) {
  try {
    chunk_sizes(8, 2, {1, 2, 3});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weights has 3 entries but there are 2 devices"), std::string::npos) << e.what();
  }
  try {
    chunk_sizes(8, 2, {1, 0});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weights[1] is 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(chunk_sizes(8, 2, {1, std::nan("")}), c10::Error);
  EXPECT_THROW(chunk_sizes(8, 0), c10::Error);
}

// Scatter of nested values: one replica's share, taken directly.
detail::ReplicaScatter replica_rows(int64_t offset, int64_t size, std::vector<torch::Tensor>* leaves = nullptr) {
  detail::ReplicaScatter s;
  s.offset = offset;
  s.size = size;
  s.leaves = leaves;
  return s;
}

TEST(Scatter, NestedValuesAreSplitAndOthersCopied) {
  using Args = std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::map<std::string, torch::Tensor>, int64_t, std::string>;
  auto x = torch::arange(10).reshape({5, 2});
  Args args{x, {x * 10, x * 100}, {{"a", x + 1}}, 7, "tag"};
  static_assert(std::is_same<detail::scatter_t<Args>, Args>::value, "containers of tensors keep their type");

  auto sites = detail::find_split_sites(0, args);
  EXPECT_EQ(sites.sites.size(), 4u);
  EXPECT_EQ(detail::batch_size_of(sites), 5);

  auto r1 = replica_rows(3, 2);
  auto part = detail::Scatter<Args>::apply(args, r1);
  EXPECT_TRUE(torch::equal(std::get<0>(part), x.narrow(0, 3, 2)));
  EXPECT_TRUE(torch::equal(std::get<1>(part)[1], (x * 100).narrow(0, 3, 2)));
  EXPECT_TRUE(torch::equal(std::get<2>(part).at("a"), (x + 1).narrow(0, 3, 2)));
  EXPECT_EQ(std::get<3>(part), 7);
  EXPECT_EQ(std::get<4>(part), "tag");
}

// Note [One list of walkable types]: every container is split on the way in
// and gathered on the way out, and anything else that might hold a tensor is
// refused at compile time (tests/compile_fail/ checks the message).
TEST(Scatter, PairOptionalAndArrayAreSplitNotCopied) {
  auto x = torch::arange(12).reshape({6, 2});
  using Args = std::tuple<std::pair<torch::Tensor, torch::Tensor>, c10::optional<torch::Tensor>,
                          std::optional<torch::Tensor>, std::array<torch::Tensor, 2>, c10::optional<torch::Tensor>>;
  Args args{{x, x + 1}, x + 2, x + 3, {x + 4, x + 5}, c10::nullopt};
  static_assert(std::is_same<detail::scatter_t<Args>, Args>::value, "containers of tensors keep their type");
  static_assert(
      std::is_same<detail::scatter_t<std::pair<Broadcast, int>>, std::pair<torch::Tensor, int>>::value,
      "markers inside containers become tensors");

  auto sites = detail::find_split_sites(0, args);
  ASSERT_EQ(sites.sites.size(), 6u); // the empty optional has nothing to split
  EXPECT_EQ(detail::format_path(sites.sites[5].path), "argument 0[3][1]");
  EXPECT_EQ(detail::batch_size_of(sites), 6);

  auto r = replica_rows(4, 2);
  auto part = detail::Scatter<Args>::apply(args, r);
  EXPECT_TRUE(torch::equal(std::get<0>(part).first, x.narrow(0, 4, 2)));
  EXPECT_TRUE(torch::equal(std::get<0>(part).second, (x + 1).narrow(0, 4, 2)));
  EXPECT_TRUE(torch::equal(*std::get<1>(part), (x + 2).narrow(0, 4, 2)));
  EXPECT_TRUE(torch::equal(*std::get<2>(part), (x + 3).narrow(0, 4, 2)));
  EXPECT_TRUE(torch::equal(std::get<3>(part)[1], (x + 5).narrow(0, 4, 2)));
  EXPECT_FALSE(std::get<4>(part).has_value());
}

TEST(Scatter, OnlyKnownContainersAndPlainValuesAreWalkable) {
  static_assert(detail::Structure<std::vector<torch::Tensor>>::is_container, "");
  static_assert(detail::Structure<std::array<torch::Tensor, 3>>::is_container, "");
  static_assert(detail::Structure<std::pair<torch::Tensor, int>>::is_container, "");
  static_assert(detail::Structure<c10::optional<torch::Tensor>>::is_container, "");
  static_assert(detail::Structure<std::optional<torch::Tensor>>::is_container, "");
  static_assert(detail::Structure<std::map<std::string, torch::Tensor>>::is_container, "");
  static_assert(detail::is_plain_value<double>::value && detail::is_plain_value<std::string>::value, "");
  static_assert(detail::is_plain_value<torch::Device>::value && detail::is_plain_value<torch::Dtype>::value, "");
  // Neither a container nor a plain value: refused, not copied.
  static_assert(!detail::Structure<std::deque<torch::Tensor>>::is_container, "");
  static_assert(!detail::is_plain_value<std::deque<torch::Tensor>>::value, "");
  static_assert(!detail::Structure<std::map<int, torch::Tensor>>::is_container, "");
  static_assert(!detail::is_plain_value<std::map<int, torch::Tensor>>::value, "");
  // lockstep::broadcast(value) is the explicit way to copy such a value whole.
  struct Config {
    int layers;
  };
  static_assert(std::is_same<detail::scatter_t<BroadcastValue<Config>>, Config>::value, "");
  auto r = replica_rows(0, 1);
  EXPECT_EQ(detail::Scatter<BroadcastValue<Config>>::apply(broadcast(Config{3}), r).layers, 3);
}

TEST(Scatter, BroadcastAndSplitMarkers) {
  auto x = torch::arange(12).reshape({4, 3});
  auto shared = torch::ones({1, 3});
  std::tuple<torch::Tensor, Broadcast, Split> args{x, broadcast(shared), lockstep::split(x.t(), 1)};
  static_assert(
      std::is_same<detail::scatter_t<decltype(args)>, std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>>::value,
      "markers become tensors");
  auto sites = detail::find_split_sites(0, args);
  ASSERT_EQ(sites.sites.size(), 2u); // the broadcast tensor is not split
  EXPECT_EQ(sites.sites[1].dim, 1);
  EXPECT_EQ(detail::batch_size_of(sites), 4);
  auto r = replica_rows(1, 2);
  auto part = detail::Scatter<decltype(args)>::apply(args, r);
  EXPECT_TRUE(torch::equal(std::get<0>(part), x.narrow(0, 1, 2)));
  EXPECT_TRUE(torch::equal(std::get<1>(part), shared));
  EXPECT_TRUE(torch::equal(std::get<2>(part), x.t().narrow(1, 1, 2)));
}

TEST(Scatter, MismatchedBatchNamesBothArgumentsAndSizes) {
  auto a = torch::zeros({10, 3});
  auto b = torch::zeros({1, 100});
  std::vector<torch::Tensor> list{a, b};
  auto message = error_of([&] {
    auto sites = detail::find_split_sites(0, a, list);
    detail::batch_size_of(sites);
  });
  EXPECT_NE(message.find("argument 0 has size 10 along dim 0"), std::string::npos) << message;
  EXPECT_NE(message.find("argument 1[1] has size 1 along dim 0"), std::string::npos) << message;
  EXPECT_NE(message.find("lockstep::broadcast"), std::string::npos) << message;
}

TEST(Scatter, ZeroDimTensorIsAnErrorAndAnEmptyBatchIsNot) {
  auto scalar = torch::tensor(3.0);
  std::map<std::string, torch::Tensor> m{{"k", scalar}};
  auto message = error_of([&] {
    auto sites = detail::find_split_sites(0, torch::zeros({4}), m);
    detail::batch_size_of(sites);
  });
  EXPECT_NE(message.find("argument 1[\"k\"] is a 0-dim tensor"), std::string::npos) << message;

  // An empty batch is a batch: it runs on replica 0, as the bare module would.
  EXPECT_EQ(detail::batch_size_of(detail::find_split_sites(0, torch::zeros({0, 4}))), 0);

  message = error_of([&] {
    auto sites = detail::find_split_sites(0, broadcast(torch::zeros({4})), 3);
    detail::batch_size_of(sites);
  });
  EXPECT_NE(message.find("no argument has a tensor to split"), std::string::npos) << message;
}

TEST(Scatter, InputsNeedingGradArePiecesLeadingBackToTheCallersTensor) {
  // Not leaves: a create_graph backward must reach x through them (Note
  // [Replica parameters]); and never x itself, whose hooks would run per replica.
  auto x = torch::randn({4, 2}, torch::requires_grad());
  std::vector<torch::Tensor> leaves;
  std::vector<detail::InputSource> sources;
  auto r = replica_rows(2, 2, &leaves);
  r.track_grad = true;
  r.sources = &sources;
  auto part = detail::Scatter<torch::Tensor>::apply(x, r);
  EXPECT_FALSE(part.is_leaf());
  EXPECT_TRUE(part.requires_grad());
  ASSERT_EQ(part.grad_fn()->next_edges().size(), 1u);
  EXPECT_EQ(part.grad_fn()->next_edges()[0].function, torch::autograd::impl::gradient_edge(x).function);
  auto whole = detail::Scatter<Broadcast>::apply(broadcast(x), r);
  EXPECT_FALSE(whole.is_same(x));
  EXPECT_FALSE(whole.is_leaf());
  ASSERT_EQ(leaves.size(), 2u);
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_TRUE(sources[0].split);
  EXPECT_TRUE(sources[0].tensor.is_same(x));
  EXPECT_FALSE(sources[1].split);
}

// Two replicas' outputs gathered as DataParallel does: flattened, each leaf
// concatenated, the structure rebuilt; `leaves` tensors are expected.
template <typename Out>
Out gather_two(const Out& a, const Out& b, size_t leaves) {
  std::vector<torch::Tensor> flat_a, flat_b;
  detail::Gather<Out>::collect(a, flat_a);
  detail::Gather<Out>::collect(b, flat_b);
  EXPECT_EQ(flat_a.size(), leaves);
  EXPECT_EQ(flat_b.size(), leaves);
  std::vector<torch::Tensor> gathered;
  for (size_t i = 0; i < flat_a.size(); ++i) {
    gathered.push_back(torch::cat({flat_a[i], flat_b[i]}));
  }
  size_t next = 0;
  Out out = detail::Gather<Out>::rebuild({&a, &b}, gathered, next);
  EXPECT_EQ(next, leaves);
  return out;
}

TEST(Gather, NestedOutputsRoundTrip) {
  using Out = std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::map<std::string, torch::Tensor>, int64_t>;
  Out a{torch::ones({2}), {torch::zeros({1}), torch::ones({3})}, {{"x", torch::full({1}, 5.0)}}, 3};
  Out b{torch::ones({1}), {torch::zeros({2}), torch::ones({1})}, {{"x", torch::full({2}, 6.0)}}, 3};
  Out out = gather_two(a, b, 4);
  EXPECT_EQ(std::get<0>(out).size(0), 3);
  EXPECT_EQ(std::get<1>(out)[0].size(0), 3);
  EXPECT_TRUE(torch::equal(std::get<2>(out).at("x"), torch::tensor({5.0f, 6.0f, 6.0f})));
  EXPECT_EQ(std::get<3>(out), 3);
}

TEST(Gather, PairOptionalAndArrayRoundTrip) {
  using Out = std::tuple<std::pair<torch::Tensor, int64_t>, c10::optional<torch::Tensor>, std::array<torch::Tensor, 2>,
                         std::optional<torch::Tensor>>;
  Out a{{torch::ones({2}), 7}, torch::zeros({2}), {torch::full({2}, 1.0), torch::full({2}, 2.0)}, std::nullopt};
  Out b{{torch::ones({1}) * 3, 7}, torch::zeros({1}) + 1, {torch::full({1}, 3.0), torch::full({1}, 4.0)}, std::nullopt};
  Out out = gather_two(a, b, 4);
  EXPECT_TRUE(torch::equal(std::get<0>(out).first, torch::tensor({1.0f, 1.0f, 3.0f})));
  EXPECT_EQ(std::get<0>(out).second, 7);
  EXPECT_TRUE(torch::equal(*std::get<1>(out), torch::tensor({0.0f, 0.0f, 1.0f})));
  EXPECT_TRUE(torch::equal(std::get<2>(out)[1], torch::tensor({2.0f, 2.0f, 4.0f})));
  EXPECT_FALSE(std::get<3>(out).has_value());

  c10::optional<torch::Tensor> set = torch::ones({1}), unset;
  size_t next = 0;
  auto message = error_of([&] { detail::Gather<c10::optional<torch::Tensor>>::rebuild({&set, &unset}, {}, next); });
  EXPECT_NE(message.find("replica 1 returned an optional that is empty but replica 0's is set"), std::string::npos)
      << message;
}

TEST(Gather, DifferingStructureOrValuesAreErrors) {
  std::vector<torch::Tensor> a{torch::ones({1})}, b{torch::ones({1}), torch::ones({1})};
  size_t next = 0;
  auto message = error_of([&] { detail::Gather<std::vector<torch::Tensor>>::rebuild({&a, &b}, {}, next); });
  EXPECT_NE(message.find("returned a std::vector of 2 elements but replica 0 returned 1"), std::string::npos) << message;

  int64_t x = 1, y = 2;
  next = 0;
  message = error_of([&] { detail::Gather<int64_t>::rebuild({&x, &y}, {}, next); });
  EXPECT_NE(message.find("different values for a non-tensor output"), std::string::npos) << message;
}

} // namespace
} // namespace lockstep
