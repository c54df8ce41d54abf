// lockstep::DataParallel's scalar outputs, edge cases, errors and CUDA
// devices (test_data_parallel.cpp has the numerical equivalence).

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/scratch.h"
#include "support/dp_models.h"
#include "support/modules.h"
#include "support/processes.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

namespace lockstep {
namespace {

using namespace testing::dp_models;

using testing::deep_copy;
using testing::expect_buffers_close;
using testing::expect_params_close;
using testing::error_of;
using testing::same_answer;

// --- scalars ---------------------------------------------------------------

TEST(DataParallel, ScalarOutputs) {
  LossNet bare;
  auto x = torch::randn({7, 3});
  auto y = torch::randn({7, 1});
  auto expected = bare(x, y);

  DataParallel<LossNet> stack(deep_copy(bare), DataParallelOptions().devices(cpus(2)));
  auto stacked = stack(x, y);
  EXPECT_EQ(stacked.sizes(), torch::IntArrayRef({2}));

  LossNet mean_net = deep_copy(bare);
  DataParallel<LossNet> mean(mean_net, DataParallelOptions().devices(cpus(2)).scalar_outputs(ScalarGather::Mean));
  auto m = mean(x, y);
  EXPECT_EQ(m.dim(), 0);
  EXPECT_TRUE(torch::allclose(m, expected, 1e-5, 1e-6));
  expected.backward();
  m.backward();
  EXPECT_TRUE(torch::allclose(bare->fc->weight.grad(), mean_net->fc->weight.grad(), 1e-5, 1e-6));

  DataParallel<LossNet> sum(deep_copy(bare), DataParallelOptions().devices(cpus(2)).scalar_outputs(ScalarGather::Sum));
  EXPECT_TRUE(torch::allclose(sum(x, y), stacked.sum(), 1e-5, 1e-6));
}

// A stacked loss of uneven chunks (4 and 3 rows) has a mean that is not the
// batch's: PyTorch warns when it stacks scalars, and so does lockstep, once
// per process as Python's warnings do. ScalarOutputs runs in a process of
// its own here, so that an earlier test's warning cannot hide this one.
TEST(DataParallel, StackedScalarsWarnAndSayWhenTheSharesDiffer) {
  const auto p = testing::run({"/proc/self/exe", "--gtest_filter=DataParallel.ScalarOutputs"}, {},
                              testing::scratch("stacked_scalars.log"), std::chrono::seconds(120));
  ASSERT_EQ(p.exit_code, 0) << p.output;
  for (const char* said : {"the replicas' values are stacked into a vector of 2", "their shares of the batch differ",
                           "scalar_outputs(ScalarGather::Mean)"}) {
    EXPECT_NE(p.output.find(said), std::string::npos) << said << " is not in:\n" << p.output;
  }
}

// A count summed over the replicas stays an integer (it came back float32,
// exact only up to 2^24); a bool one counts as int64, as torch::sum does.
struct CountsImpl : torch::nn::Cloneable<CountsImpl> {
  CountsImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(3, 1));
  }
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    return {fc(x), (x > 0).sum(), (x > 100).any()};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Counts);

TEST(DataParallel, SummedIntegerAndBoolScalarsStayCounts) {
  Counts net;
  DataParallel<Counts> dp(net, DataParallelOptions().devices(cpus(2)).scalar_outputs(ScalarGather::Sum));
  auto x = torch::randn({7, 3});
  auto [out, positive, huge] = dp(x);
  EXPECT_EQ(positive.scalar_type(), torch::kLong);
  EXPECT_EQ(positive.item<int64_t>(), (x > 0).sum().item<int64_t>());
  EXPECT_EQ(huge.scalar_type(), torch::kLong);
  EXPECT_EQ(huge.item<int64_t>(), 0);
}

// The share-weighted mean of a count is a fraction (7 rows: 10 became
// 5.14 as a float): Mean refuses integer and bool 0-dim outputs by index.
TEST(DataParallel, AMeanOfIntegerOrBoolScalarsIsAnErrorNamingTheOutput) {
  Counts net;
  DataParallel<Counts> dp(net, DataParallelOptions().devices(cpus(2)).scalar_outputs(ScalarGather::Mean));
  EXPECT_ERROR_SAYS(dp(torch::randn({7, 3})), "output tensor 1 is a 0-dim Long tensor, and ScalarGather::Mean would "
                    "turn it into a fraction", "Use ScalarGather::Sum");
}

// --- edge cases and errors ---------------------------------------------------

TEST(DataParallel, ChunksFollowWeightsAndSmallBatchesUseFewerReplicas) {
  Counter net;
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(3)).weights({3, 1, 4}));
  dp(torch::randn({16, 4}));
  EXPECT_EQ(dp->map_replicas([](CounterImpl& m) { return m.rows_seen; }), (std::vector<int64_t>{6, 2, 8}));

  Counter net2;
  DataParallel<Counter> dp2(net2, DataParallelOptions().devices(cpus(3)));
  auto x = torch::randn({2, 4});
  auto out = dp2(x);
  EXPECT_EQ(out.size(0), 2);
  EXPECT_TRUE(same_answer(out, net2(x)));
  // net2(x) ran the wrapped module itself, which is not replica 0 (Note [Replica 0]).
  EXPECT_EQ(dp2->map_replicas([](CounterImpl& m) { return m.calls; }), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(net2->calls, 1);
}

// With weights, replica 0 can get no rows: under Broadcast the module keeps
// the statistics of the first replica that ran instead of skipping the step.
TEST(DataParallel, BatchNormStatisticsMoveWhenReplicaZeroGetsNoRows) {
  torch::manual_seed(3);
  const auto x = torch::randn({3, 4}) * 2 + 1;
  torch::nn::BatchNorm1d bare(4);
  torch::nn::BatchNorm1d wrapped(4);
  DataParallel<torch::nn::BatchNorm1d> dp(wrapped, DataParallelOptions().devices(cpus(2)).weights({0.01, 1}));
  for (int step = 0; step < 2; ++step) {
    bare(x);
    dp(x);
  }
  ASSERT_EQ(chunk_sizes(3, 2, {0.01, 1}), (std::vector<int64_t>{0, 3})) << "replica 0 was meant to get no rows";
  EXPECT_TRUE(torch::allclose(wrapped->running_mean, bare->running_mean, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(wrapped->running_var, bare->running_var, 1e-6, 1e-6));
  EXPECT_EQ(wrapped->num_batches_tracked.item<int64_t>(), 2);
}

TEST(DataParallel, OneRowOnTwoReplicasTrainsLikeBareModule) {
  torch::manual_seed(8);
  auto x = torch::randn({1, 16});
  auto y = torch::randn({1, 4});
  expect_same_training(Mlp(), DataParallelOptions().devices(cpus(2)), 3, [&](int, auto&& run) {
    return torch::mse_loss(run(x), y);
  });
  // Sum of a single running replica's scalar is that scalar itself.
  LossNet bare;
  LossNet net = deep_copy(bare);
  DataParallel<LossNet> dp(net, DataParallelOptions().devices(cpus(3)).scalar_outputs(ScalarGather::Sum));
  auto loss = dp(torch::randn({1, 3}), torch::randn({1, 1}));
  loss.backward();
  EXPECT_TRUE(net->fc->weight.grad().defined());
}

TEST(DataParallel, MismatchedBatchSizesAreAClearError) {
  TwoInput net;
  DataParallel<TwoInput> dp(net, DataParallelOptions().devices(cpus(2)));
  auto message = error_of([&] { dp(torch::randn({10, 8}), torch::randn({1, 8})); });
  EXPECT_NE(message.find("argument 0 has size 10 along dim 0 but argument 1 has size 1"), std::string::npos) << message;
  EXPECT_NE(message.find("lockstep::broadcast"), std::string::npos) << message;
  // With the hint, the batch-1 tensor goes whole to every replica and the output keeps all 10 rows.
  EXPECT_EQ(dp(torch::randn({10, 8}), broadcast(torch::randn({1, 8}))).size(0), 10);
}

// Changes its whole (broadcast) argument in place, as a stateful forward may.
struct ScalesStateImpl : torch::nn::Cloneable<ScalesStateImpl> {
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& state) {
    if (change_) {
      state.mul_(2);
    }
    return x * state;
  }
  bool change_ = true;
};
TORCH_MODULE(ScalesState);

// CPU replicas receive a broadcast tensor as the caller's own: changed in
// place, each replica changed it under the others (the bare module's 2
// became 16 on 4 replicas). That is an error; reading it is not.
TEST(DataParallel, ABroadcastTensorChangedInPlaceInForwardIsAnError) {
  ScalesState net;
  DataParallel<ScalesState> dp(net, DataParallelOptions().devices(cpus(4)));
  auto state = torch::ones({1});
  EXPECT_ERROR_SAYS(dp(torch::ones({8, 1}), broadcast(state)),
                    "a tensor passed whole (lockstep::broadcast) was changed in place during forward",
                    "t = t.clone()");
  net->change_ = false;
  for (auto& replica : dp->replicas()) {
    replica->change_ = false;
  }
  EXPECT_TRUE(torch::equal(dp(torch::ones({8, 1}), broadcast(torch::full({1}, 3.0))), torch::full({8, 1}, 3.0)));
}

TEST(DataParallel, ReplicaErrorNamesReplicaAndDeviceAndStaysUsable) {
  Counter net;
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(2)));
  auto x = torch::randn({4, 4});
  x[3][0] = -1000; // row 3 belongs to replica 1
  auto message = error_of([&] { dp(x); });
  EXPECT_NE(message.find("replica 1 on cpu failed in forward"), std::string::npos) << message;
  EXPECT_NE(message.find("bad input row"), std::string::npos) << message;
  auto good = torch::randn({4, 4});
  auto out = dp(good);
  // Two rows per replica against four in the bare module: 2.x's GEMM may
  // round differently by batch size, so values near 0 need an absolute slack.
  EXPECT_TRUE(torch::allclose(out, net(good), 1e-5, 1e-6));
}

TEST(DataParallel, StateKeptOnReplicasSumsToBareCount) {
  Counter bare;
  Counter net = deep_copy(bare);
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(3)));
  for (int64_t rows : {5, 9, 2, 12}) {
    auto x = torch::randn({rows, 4});
    bare(x);
    dp(x);
  }
  auto per_replica = dp->map_replicas([](CounterImpl& m) { return m.rows_seen; });
  EXPECT_EQ(per_replica.size(), 3u);
  EXPECT_EQ(std::accumulate(per_replica.begin(), per_replica.end(), int64_t{0}), bare->rows_seen);
  // Replica 0 is a clone sharing the module's parameters (Note [Replica 0]):
  // C++ member state lives on the replicas, not on the wrapped module.
  EXPECT_EQ(dp->module()->rows_seen, 0);
  EXPECT_EQ(dp->replicas().size(), 3u);
  EXPECT_NE(dp->replicas()[0].ptr(), net.ptr());
  EXPECT_EQ(dp->replicas()[0]->parameters()[0].data_ptr(), net->parameters()[0].data_ptr());
  dp->map_replicas([](CounterImpl& m) { m.rows_seen = 0; });
  EXPECT_EQ(dp->replicas()[2]->rows_seen, 0);
}

TEST(DataParallel, OptimizerStepIsSeenByEveryReplica) {
  Mlp net;
  DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
  torch::optim::SGD opt(dp->parameters(), 0.5);
  dp(torch::randn({4, 16})).sum().backward();
  opt.step();
  auto replicas = dp->replicas();
  EXPECT_TRUE(torch::equal(replicas[1]->fc1->weight, net->fc1->weight));
  // CPU replicas share storage with the wrapped module: nothing is copied.
  EXPECT_EQ(replicas[1]->fc1->weight.data_ptr(), net->fc1->weight.data_ptr());
  EXPECT_FALSE(replicas[1]->fc1->weight.is_same(net->fc1->weight));
  EXPECT_EQ(dp->parameters().size(), net->parameters().size());
}

TEST(DataParallel, SaveAndLoadBetweenWrappedAndBareModule) {
  const std::string path = testing::scratch("dp_checkpoint.pt");
  Mlp source;
  DataParallel<Mlp> dp(source, DataParallelOptions().devices(cpus(2)));
  torch::save(dp, path);
  Mlp bare;
  torch::load(bare, path);
  expect_params_close(*bare, *source, 0, 0);
  for (const auto& p : dp->named_parameters()) {
    EXPECT_EQ(p.key().rfind("module.", 0), 0u); // the prefix lives in names only, not in files
  }

  Mlp other;
  torch::save(other, path);
  torch::load(dp, path);
  expect_params_close(*other, *source, 0, 0);
  auto x = torch::randn({6, 16});
  EXPECT_TRUE(same_answer(dp(x), other(x))); // replica 1 sees the loaded values too
  std::remove(path.c_str());
}

// The replicas are clones made at wrapping: a submodule replaced or a
// tensor registered afterwards was silently left out of them.
TEST(DataParallel, AModuleChangedAfterWrappingIsAnError) {
  const auto x = torch::randn({6, 16});
  {
    Mlp net;
    DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
    dp(x);
    net->fc2 = net->replace_module("fc2", torch::nn::Linear(32, 3));
    EXPECT_ERROR_SAYS(dp(x), "the wrapped module changed after it was wrapped (its parameters are not the ones",
                      "Wrap the module again");
  }
  {
    Mlp net;
    DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
    net->fc1->register_parameter("scale", torch::ones({1}));
    EXPECT_ERROR_SAYS(dp(x), "(its parameters are not the ones");
  }
  {
    Cnn net;
    DataParallel<Cnn> dp(net, DataParallelOptions().devices(cpus(2)));
    net->bn->register_buffer("count", torch::zeros({1}));
    EXPECT_ERROR_SAYS(dp(torch::randn({4, 1, 6, 6})), "(its buffers are not the ones");
  }
  {
    Mlp net;
    DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
    torch::NoGradGuard no_grad;
    net->fc1->weight.set_data(torch::ones_like(net->fc1->weight)); // new values in the same tensors: fine
    EXPECT_TRUE(same_answer(dp(x), net(x)));
  }
}

TEST(DataParallel, ModesAndInference) {
  Cnn net;
  DataParallel<Cnn> dp(net, DataParallelOptions().devices(cpus(2)));
  dp->eval();
  EXPECT_FALSE(net->is_training());
  EXPECT_FALSE(dp->replicas()[1]->is_training());
  auto x = torch::randn({4, 1, 6, 6});
  torch::NoGradGuard no_grad;
  auto out = dp(x);
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(torch::allclose(out, net(x), 1e-5, 1e-6));
}

TEST(DataParallel, ToDoubleMovesReplicasToo) {
  Mlp net;
  DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
  dp->to(torch::kFloat64);
  auto x = torch::randn({4, 16}, torch::kFloat64);
  auto out = dp(x);
  EXPECT_EQ(out.scalar_type(), torch::kFloat64);
  EXPECT_TRUE(same_answer(out, net(x)));
}

TEST(DataParallel, OneDeviceRunsTheModuleDirectly) {
  Counter net;
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(1)));
  auto x = torch::randn({3, 4});
  EXPECT_TRUE(torch::equal(dp(x), net(x)));
  EXPECT_EQ(dp->map_replicas([](CounterImpl& m) { return m.calls; }), (std::vector<int64_t>{2}));
}

TEST(DataParallel, SequentialAndDefaultDevices) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  seq->to(default_devices()[0]); // every GPU where there are some: the module goes on the first
  DataParallel<torch::nn::Sequential> dp(seq);
  EXPECT_EQ(dp->devices(), default_devices());
  auto x = torch::randn({5, 4}).to(default_devices()[0]);
  EXPECT_TRUE(torch::allclose(dp->forward(x), seq->forward(x), 1e-6, 1e-6));
}

TEST(DataParallel, BadOptionsAreClearErrors) {
  auto message = error_of([] { DataParallel<Mlp> dp(Mlp(), DataParallelOptions().devices(cpus(2)).weights({1})); });
  EXPECT_NE(message.find("weights has 1 entries but there are 2 devices"), std::string::npos) << message;
  if (!torch::cuda::is_available()) {
    message = error_of([] {
      DataParallel<Mlp> dp(Mlp(), DataParallelOptions().devices({torch::kCPU, torch::Device(torch::kCUDA, 0)}));
    });
    EXPECT_NE(message.find("devices[1] is cuda:0 but this process sees 0 CUDA device(s)"), std::string::npos) << message;
  }
  // Each failed only after every replica had run forward, in a raw error
  // from the copy to the output device, or asked OpenMP for 2^32 threads.
  const torch::Device absent(torch::kCUDA, 100);
  EXPECT_ERROR_SAYS(DataParallel<Mlp>(Mlp(), DataParallelOptions().devices(cpus(2)).output_device(absent)),
                    "output_device is cuda:100 but this process sees");
  EXPECT_ERROR_SAYS(DataParallel<Mlp>(Mlp(), DataParallelOptions().devices(cpus(2)).output_device(torch::kMeta)),
                    "output_device is meta; DataParallel gathers outputs on a CPU or a CUDA device");
  EXPECT_ERROR_SAYS(DataParallel<Mlp>(Mlp(), DataParallelOptions().devices(cpus(2)).intra_op_threads(4294967300LL)),
                    "intra_op_threads must be from 0 (0 splits the cores) to 4096, but got 4294967300");
}

// Sums over dim 0: an input [4, N] split along dim 1 gives outputs [N / 2].
struct ColumnSumsImpl : torch::nn::Cloneable<ColumnSumsImpl> {
  ColumnSumsImpl() {
    reset();
  }
  void reset() override {
    scale = register_parameter("scale", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return (x * scale).sum(0);
  }
  torch::Tensor scale;
};
TORCH_MODULE(ColumnSums);

// The outputs lacked the dim the inputs were split along: a raw "Dimension
// out of range" that named neither the option nor the output.
TEST(DataParallel, AnOutputWithoutTheSplitDimIsAClearError) {
  DataParallel<ColumnSums> dp(ColumnSums(), DataParallelOptions().devices(cpus(2)).dim(1));
  EXPECT_ERROR_SAYS(dp(torch::randn({4, 6})), "DataParallelOptions::dim is 1, but a replica's output has 1 "
                    "dimension(s) (sizes [3])");
}

// A parameter on a device other than devices[0], on any machine.
struct OffDeviceImpl : torch::nn::Cloneable<OffDeviceImpl> {
  OffDeviceImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    extra = register_parameter("extra", torch::empty({4}, torch::kMeta));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor extra;
};
TORCH_MODULE(OffDevice);

TEST(DataParallel, ParameterOffFirstDeviceIsAClearError) {
  auto message = error_of([&] { DataParallel<OffDevice> dp(OffDevice(), DataParallelOptions().devices(cpus(2))); });
  EXPECT_NE(message.find("parameter 'extra' is on meta but devices[0] is cpu"), std::string::npos) << message;
  EXPECT_NE(message.find("call module->to(cpu)"), std::string::npos) << message;
}

// --- CUDA ----------------------------------------------------------------------

TEST(DataParallel, ParameterOffFirstDeviceIsAClearError_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  Mlp net;
  net->fc2->to(torch::Device(torch::kCUDA, 0));
  auto message = error_of([&] { DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2))); });
  EXPECT_NE(message.find("parameter 'fc2.weight' is on cuda:0 but devices[0] is cpu"), std::string::npos) << message;
}

// 4 SGD steps of an Mlp on devices[0] through DataParallel over `devices`
// equal 4 of the bare module.
void expect_mlp_trains_as_bare(const std::vector<torch::Device>& devices) {
  Mlp bare;
  bare->to(devices[0]);
  auto x = torch::randn({10, 16}, devices[0]);
  auto y = torch::randn({10, 4}, devices[0]);
  expect_same_training(bare, DataParallelOptions().devices(devices), 4,
                       [&](int, auto&& run) { return torch::mse_loss(run(x), y); });
}

TEST(DataParallel, MlpMatchesBareModule_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device gpu(torch::kCUDA, 0);
  expect_mlp_trains_as_bare({gpu, gpu});
}

// A replica on another device than the module is a copy: LibTorch's SGD
// steps through .data(), which moves no version counter, so a copy made
// only when the counter moved kept the CPU replica on the first weights.
TEST(DataParallel, SgdReachesAReplicaOnAnotherDevice_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  expect_mlp_trains_as_bare({torch::Device(torch::kCUDA, 0), torch::Device(torch::kCPU)});
}

// Records the stream current on its input's device each time it runs.
struct StreamProbeImpl : torch::nn::Cloneable<StreamProbeImpl> {
  StreamProbeImpl() {
    reset();
  }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto stream = c10::impl::getDeviceGuardImpl(x.device().type())->getStream(x.device());
    std::lock_guard<std::mutex> lock(mutex);
    seen.push_back(stream.id());
    return linear(x);
  }
  torch::nn::Linear linear{nullptr};
  static std::mutex mutex;
  static std::vector<c10::StreamId> seen;
};
std::mutex StreamProbeImpl::mutex;
std::vector<c10::StreamId> StreamProbeImpl::seen;
TORCH_MODULE(StreamProbe);

// The caller's work on its current stream (here the input, made on a side
// stream) is ordered before the replicas' only if they run on that stream
// too; on the device's default stream they could read it unfinished.
TEST(DataParallel, ReplicasRunOnTheCallersCurrentStream_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device gpu(torch::kCUDA, 0);
  const auto* impl = c10::impl::getDeviceGuardImpl(torch::kCUDA);
  const auto side = impl->getStreamFromGlobalPool(gpu);
  ASSERT_NE(side, impl->getDefaultStream(gpu));
  StreamProbe net;
  net->to(gpu);
  auto bare = deep_copy(net);
  DataParallel<StreamProbe> dp(net, DataParallelOptions().devices({gpu, gpu}));
  torch::Tensor x, out;
  {
    c10::StreamGuard on_side(side);
    x = torch::randn({64, 4}, gpu) * 2;
    StreamProbeImpl::seen.clear();
    out = dp(x);
    out.sum().backward();
    impl->synchronizeStream(side);
  }
  ASSERT_EQ(StreamProbeImpl::seen.size(), 2u);
  for (auto id : StreamProbeImpl::seen) {
    EXPECT_EQ(id, side.id()) << "a replica ran on stream " << id << ", not the caller's " << side.id();
  }
  auto expected = bare(x);
  expected.sum().backward();
  EXPECT_TRUE(torch::allclose(out, expected));
  EXPECT_TRUE(torch::allclose(net->linear->weight.grad(), bare->linear->weight.grad()));
}

TEST(DataParallel, MlpMatchesBareModuleOnTwoGpus_MultiCUDA) {
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "fewer than 2 CUDA devices";
  }
  expect_mlp_trains_as_bare({torch::Device(torch::kCUDA, 0), torch::Device(torch::kCUDA, 1)});
}

// A zero .grad that is a view of one flat buffer (or that the caller keeps)
// is added into, as AccumulateGrad does: backward replaced it with a new
// tensor, and the buffer stayed zero.
TEST(DataParallel, AZeroGradThatIsAViewOfAFlatBufferIsAddedInto) {
  torch::manual_seed(2);
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::Tanh(), torch::nn::Linear(3, 2));
  auto bare = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
  int64_t total = 0;
  for (const auto& p : net->parameters()) {
    total += p.numel();
  }
  auto flat = torch::zeros({total});
  int64_t at = 0;
  for (auto& p : net->parameters()) {
    p.mutable_grad() = flat.narrow(0, at, p.numel()).view_as(p);
    at += p.numel();
  }
  DataParallel<torch::nn::Sequential> dp(net, DataParallelOptions().devices(cpus(2)));
  const auto x = torch::randn({6, 4});
  dp(x).pow(2).sum().backward();
  bare->forward(x).pow(2).sum().backward();
  at = 0;
  const auto mine = net->parameters();
  const auto theirs = bare->parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto slice = flat.narrow(0, at, mine[i].numel()).view_as(mine[i]);
    EXPECT_EQ(mine[i].grad().data_ptr(), slice.data_ptr()) << "the .grad is no longer the buffer's view";
    EXPECT_TRUE(torch::allclose(slice, theirs[i].grad(), 1e-5, 1e-6)) << i;
    at += mine[i].numel();
  }
  EXPECT_GT(flat.abs().sum().item<float>(), 0.0f);
}

} // namespace
} // namespace lockstep
