// The pure tests of the rest: bucket assignment, the launch environment,
// SyncBatchNorm and join's checks with the group of one, the desync report
// and the command lines' checks (test_scatter_gather.cpp has DataParallel's
// splitting). No threads, no process groups between ranks; they run in
// seconds.

#include <lockstep/detail/checked_file.h>
#include <lockstep/detail/launch_env.h>
#include <lockstep/detail/reducer.h>
#include <lockstep/detail/sockets.h>
#include <lockstep/distributed_data_parallel.h>
#include <lockstep/sync_batch_norm.h>

#include "../src/store.h"
#include "support/errors.h"
#include "support/scratch.h"

#include <tools/desync_report.h>
#include <tools/run_options.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <sys/resource.h>
#include <unistd.h>

namespace lockstep {
namespace {

using testing::error_of;

// --- bucket assignment ---------------------------------------------------------

TEST(BucketAssignment, ReverseOrderFirstBucketSmall) {
  const std::vector<std::string> keys(6, "float");
  // 4 bytes each; first cap 8 bytes, later caps 12 bytes.
  auto buckets = detail::compute_bucket_assignment({4, 4, 4, 4, 4, 4}, keys, 8, 12);
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{5, 4}, {3, 2, 1}, {0}}));
}

TEST(BucketAssignment, LargeParameterGetsItsOwnBucketAndEmptyOnesFit) {
  const std::vector<std::string> keys(4, "float");
  auto buckets = detail::compute_bucket_assignment({0, 100, 0, 3}, keys, 8, 12);
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{3, 2, 1}, {0}}));
}

TEST(BucketAssignment, DtypesNeverShareABucket) {
  auto buckets = detail::compute_bucket_assignment({4, 4, 4, 4}, {"float", "double", "float", "double"}, 100, 100);
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{3, 1}, {2, 0}}));
}

TEST(BucketAssignment, FollowsAGivenOrder) {
  const std::vector<std::string> keys(6, "float");
  // The order gradients became ready in: the same caps as above.
  auto buckets = detail::compute_bucket_assignment({4, 4, 4, 4, 4, 4}, keys, 8, 12, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{0, 1}, {2, 3, 4}, {5}}));
  EXPECT_ERROR_SAYS(detail::compute_bucket_assignment({4, 4}, {"f", "f"}, 8, 12, {1, 1}), "not a permutation");
}

TEST(BucketAssignment, EveryParameterExactlyOnce) {
  std::vector<int64_t> bytes;
  for (int i = 0; i < 37; ++i) {
    bytes.push_back((i * 7919) % 1000);
  }
  auto buckets = detail::compute_bucket_assignment(bytes, std::vector<std::string>(37, "k"), 1000, 3000);
  std::vector<int> seen(37, 0);
  for (const auto& b : buckets) {
    for (size_t i : b) {
      ++seen[i];
    }
  }
  EXPECT_EQ(seen, std::vector<int>(37, 1));
}

TEST(BucketAssignment, DefaultsAreOneAndTwentyFiveMiB) {
  EXPECT_EQ(kFirstBucketBytes, 1 << 20);
  EXPECT_EQ(DistributedOptions().bucket_bytes(), 25 << 20);
}

// --- environment ------------------------------------------------------------------

std::function<const char*(const char*)> env_of(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

TEST(LaunchEnv, ReadsTorchrunVariables) {
  auto env = detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                                                     {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"},
                                                                     {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

// DeepSpeed's launcher and hand-written scripts set LOCAL_RANK without
// LOCAL_WORLD_SIZE; PyTorch's init_process_group takes them.
TEST(LaunchEnv, LocalRankWithoutLocalWorldSizeIsTaken) {
  auto env = detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                                                     {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.local_rank, 1);
}

// lockstep-run's one-node store waits as long as the group does, not
// c10d's 300 s default (NCCL fetches its id through it at the first
// collective, and user code may wait on it).
TEST(LaunchEnv, LockstepRunsFileStoreTakesTheGroupsTimeout) {
  const std::string path = testing::scratch("store_timeout");
  ASSERT_EQ(setenv("LOCKSTEP_STORE_FILE", path.c_str(), 1), 0);
  detail::LaunchEnv env;
  env.timeout = std::chrono::milliseconds(1500);
  auto store = detail::make_store(env, ProcessGroupOptions());
  unsetenv("LOCKSTEP_STORE_FILE");
  EXPECT_EQ(store->getTimeout(), std::chrono::milliseconds(1500));
  std::remove(path.c_str());
}

TEST(LaunchEnv, TorchrunsAgentStoreMakesEveryRankAClient) {
  std::map<std::string, std::string> vars{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  EXPECT_FALSE(detail::parse_launch_env(ProcessGroupOptions(), env_of(vars)).agent_store);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  vars["TORCHELASTIC_RESTART_COUNT"] = "2";
  auto env = detail::parse_launch_env(ProcessGroupOptions(), env_of(vars));
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.restart_count, 2);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_FALSE(detail::parse_launch_env(ProcessGroupOptions(), env_of(vars)).agent_store);
}

TEST(LaunchEnv, MissingOrMalformedVariablesNameThemselves) {
  auto message = error_of([] { detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "0"}})); });
  EXPECT_NE(message.find("WORLD_SIZE is not set"), std::string::npos) << message;
  message = error_of([] { detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "x1"}, {"WORLD_SIZE", "2"}})); });
  EXPECT_NE(message.find("RANK=\"x1\" is malformed; expected a whole number in [0, WORLD_SIZE)"), std::string::npos) << message;
  message = error_of([] {
    detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                                                            {"MASTER_PORT", "70000"}}));
  });
  EXPECT_NE(message.find("MASTER_PORT=\"70000\" is malformed; expected a port number"), std::string::npos) << message;
  message = error_of([] { detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}})); });
  EXPECT_NE(message.find("MASTER_ADDR is not set"), std::string::npos) << message;
  message = error_of([] { detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "5"}, {"WORLD_SIZE", "2"}})); });
  EXPECT_NE(message.find("RANK=5 is out of range for WORLD_SIZE=2"), std::string::npos) << message;
  message = error_of([] {
    detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                                                            {"LOCAL_RANK", "2"}}));
  });
  EXPECT_NE(message.find("LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"), std::string::npos) << message;
}

TEST(LaunchEnv, TimeoutComesFromOptionsThenLockstepTimeout) {
  std::map<std::string, std::string> vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), env_of(vars)).timeout, kDefaultTimeout);
  vars["LOCKSTEP_TIMEOUT"] = "7";
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), env_of(vars)).timeout, std::chrono::seconds(7));
  const auto explicit_timeout = std::chrono::milliseconds(1500);
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions().timeout(explicit_timeout), env_of(vars)).timeout,
            explicit_timeout);
  vars["LOCKSTEP_TIMEOUT"] = "5m";
  auto message = error_of([&] { detail::parse_launch_env(ProcessGroupOptions(), env_of(vars)); });
  EXPECT_NE(message.find("LOCKSTEP_TIMEOUT=\"5m\" is malformed; expected whole seconds"), std::string::npos) << message;
  message = error_of([&] {
    detail::parse_launch_env(ProcessGroupOptions().timeout(std::chrono::milliseconds(-1)), env_of(vars));
  });
  EXPECT_NE(message.find("ProcessGroupOptions::timeout is -1 ms"), std::string::npos) << message;
  // Longer than LOCKSTEP_TIMEOUT's 7 days overflowed the init deadline into
  // about 2 s, and MPI's waits into none at all.
  message = error_of([&] {
    detail::parse_launch_env(ProcessGroupOptions().timeout(std::chrono::milliseconds::max()), env_of(vars));
  });
  EXPECT_NE(message.find("ProcessGroupOptions::timeout is 9223372036854775807 ms; expected a positive duration of "
                         "at most 7 days"), std::string::npos) << message;
  for (auto bad : {std::chrono::milliseconds(0), std::chrono::milliseconds(-5)}) {
    message = error_of([&] { new_group(c10::make_intrusive<c10d::HashStore>(), 0, 2, "gloo", bad); });
    EXPECT_NE(message.find("new_group's timeout is " + std::to_string(bad.count()) + " ms"), std::string::npos)
        << message;
  }
}

TEST(LaunchEnv, MpiLaunchersGiveRankAndSizeWithoutAStore) {
  auto env = detail::parse_launch_env(ProcessGroupOptions(), env_of({{"OMPI_COMM_WORLD_RANK", "2"},
      {"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}}));
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.local_rank, 0);
  ASSERT_NE(env.mpi_launcher, nullptr);
  EXPECT_STREQ(env.mpi_launcher, "Open MPI's mpirun");
  EXPECT_TRUE(env.master_addr.empty()); // no store, no MASTER_ADDR needed
  env = detail::parse_launch_env(ProcessGroupOptions(), env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                                                  {"SLURM_LOCALID", "1"}, {"SLURM_STEP_ID", "0"}}));
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.local_rank, 1);
  // A batch script has Slurm's rank and size too, but is no task of a step:
  // one process, which must not wait for 7 others.
  const auto batch = env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(detail::find_mpi_launcher(batch), nullptr);
  EXPECT_NE(error_of([&] { detail::parse_launch_env(ProcessGroupOptions(), batch); })
                .find("environment variable WORLD_SIZE is not set"), std::string::npos);
  // torchrun's variables win over a launcher's.
  env = detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                                                  {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  EXPECT_EQ(env.mpi_launcher, nullptr);
  EXPECT_EQ(env.world_size, 1);
  auto message = error_of([] {
    detail::parse_launch_env(ProcessGroupOptions(), env_of({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  });
  EXPECT_NE(message.find("OMPI_COMM_WORLD_RANK=\"4\" is malformed"), std::string::npos) << message;
}

TEST(LaunchEnv, WorldSizeOneNeedsNoStore) {
  auto env = detail::parse_launch_env(ProcessGroupOptions().rank(0).world_size(1), env_of({}));
  EXPECT_EQ(env.world_size, 1);
  auto group = init_process_group(ProcessGroupOptions().rank(0).world_size(1));
  EXPECT_EQ(group.size(), 1);
  auto t = torch::ones({3});
  group.allreduce(t, ReduceOp::Avg);
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
}

// --- Where a server listens (Note [A server named by a host name]) -----------

// This machine's first IPv4 address that is not loopback, or "".
std::string outward_address() {
  std::string found;
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) {
    return found;
  }
  for (const ifaddrs* i = all; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET && !detail::is_loopback(i->ifa_addr)) {
      char text[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
      found = text;
    }
  }
  ::freeifaddrs(all);
  return found;
}

// Whether a TCP connection to address:port is accepted (a listening
// socket's backlog completes it, so no thread has to accept).
bool connects(const std::string& address, int port) {
  const auto to = detail::resolve_tcp(address, port, AI_NUMERICHOST | AI_NUMERICSERV);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = to.first() != nullptr && ::connect(fd, to.first()->ai_addr, to.first()->ai_addrlen) == 0;
  ::close(fd);
  return ok;
}

TEST(ServerAddress, NamesOfLoopbackItselfAreToldFromMachineNames) {
  for (const char* host : {"localhost", "localhost.localdomain", "ip6-localhost", "127.0.0.1", "127.0.1.1", "::1"}) {
    EXPECT_TRUE(detail::names_loopback(host)) << host;
  }
  for (const char* host : {"trainer-0", "node.example", "10.0.0.1", "192.0.2.2", "::ffff:10.0.0.1"}) {
    EXPECT_FALSE(detail::names_loopback(host)) << host;
  }
}

// Debian maps the machine's own name to loopback; the other machines
// resolve it to a real address, so a server named by it must answer there.
TEST(ServerAddress, AServerNamedByAHostNameThatIsLoopbackHereAnswersOnEveryInterface) {
  char name[256] = {};
  ASSERT_EQ(::gethostname(name, sizeof(name) - 1), 0);
  const auto here = detail::resolve_tcp(name, 0);
  const std::string outward = outward_address();
  if (here.first() == nullptr || !detail::is_loopback(here.first()->ai_addr) || outward.empty()) {
    GTEST_SKIP() << "needs a host name that resolves to loopback (Debian's /etc/hosts) and an outward address; '"
                 << name << "' and '" << outward << "'";
  }
  const auto by_name = detail::listen_as(name, 0);
  ASSERT_GE(by_name.fd, 0) << by_name.error;
  const int port = detail::bound_port(by_name.fd);
  EXPECT_TRUE(by_name.every_interface);
  EXPECT_TRUE(connects(outward, port)) << "'" << name << "' on " << outward << ":" << port;
  EXPECT_TRUE(connects("127.0.0.1", port));
  EXPECT_LT(detail::listen_as(name, port).fd, 0) << "a second server at the same port";
  ::close(by_name.fd);

  const auto by_loopback = detail::listen_as("127.0.0.1", 0);
  ASSERT_GE(by_loopback.fd, 0) << by_loopback.error;
  EXPECT_FALSE(by_loopback.every_interface);
  EXPECT_FALSE(connects(outward, detail::bound_port(by_loopback.fd))) << "a server named as loopback stays there";
  ::close(by_loopback.fd);
  EXPECT_LT(detail::listen_as("192.0.2.254", 0).fd, 0) << "an address of another machine";
}

// --- SyncBatchNorm with the group of one ----------------------------------------

TEST(SyncBatchNorm, GroupOfOneIsBatchNormExactly) {
  torch::manual_seed(1);
  torch::nn::BatchNorm2d bn(torch::nn::BatchNormOptions(3).momentum(0.2));
  SyncBatchNorm sync(torch::nn::BatchNormOptions(3).momentum(0.2));
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, 3, 2, 5}) * 3 + 1;
    auto a = x.clone().requires_grad_(true);
    auto b = x.clone().requires_grad_(true);
    auto ya = bn(a);
    auto yb = sync(b);
    EXPECT_TRUE(torch::equal(ya, yb));
    (ya * ya).sum().backward();
    (yb * yb).sum().backward();
    EXPECT_TRUE(torch::equal(a.grad(), b.grad()));
    EXPECT_TRUE(torch::equal(bn->weight.grad(), sync->weight.grad()));
  }
  EXPECT_TRUE(torch::equal(bn->running_mean, sync->running_mean));
  EXPECT_TRUE(torch::equal(bn->running_var, sync->running_var));
  bn->eval();
  sync->eval();
  auto x = torch::randn({2, 3, 4, 4});
  EXPECT_TRUE(torch::equal(bn(x), sync(x)));
}

TEST(SyncBatchNorm, CheckpointsMoveToAndFromBatchNorm2d) {
  torch::manual_seed(2);
  SyncBatchNorm sync(torch::nn::BatchNormOptions(4));
  sync(torch::randn({6, 4, 3, 3}) + 2); // running statistics away from 0 and 1
  {
    torch::NoGradGuard no_grad;
    sync->weight.uniform_();
  }
  std::stringstream file;
  torch::save(sync, file);
  torch::nn::BatchNorm2d bn(4);
  torch::load(bn, file);
  for (const auto& name : {"weight", "bias"}) {
    EXPECT_TRUE(torch::equal(bn->named_parameters()[name], sync->named_parameters()[name])) << name;
  }
  for (const auto& name : {"running_mean", "running_var", "num_batches_tracked"}) {
    EXPECT_TRUE(torch::equal(bn->named_buffers()[name], sync->named_buffers()[name])) << name;
  }
  std::stringstream back;
  torch::save(bn, back);
  SyncBatchNorm again(torch::nn::BatchNormOptions(4));
  torch::load(again, back);
  EXPECT_TRUE(torch::equal(again->running_mean, sync->running_mean));
}

TEST(SyncBatchNorm, WrongInputShapeIsAClearError) {
  SyncBatchNorm sync(torch::nn::BatchNormOptions(4));
  EXPECT_ERROR_SAYS(sync(torch::randn({2, 3, 5})), "expected input of shape (N, 4, *), but got [2, 3, 5]");
  EXPECT_ERROR_SAYS(sync(torch::randn({4})), "expected input of shape (N, 4, *)");
}

struct MemberNetImpl : torch::nn::Module {
  MemberNetImpl() {
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4)));
    norm = register_module("norm", torch::nn::BatchNorm1d(4));
  }
  torch::nn::Sequential body{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(MemberNet);

struct ContainersNetImpl : torch::nn::Module {
  ContainersNetImpl() {
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2)));
    list = register_module("list", torch::nn::ModuleList(torch::nn::BatchNorm2d(2), torch::nn::Linear(2, 2)));
    dict = register_module("dict", torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
                                       {"bn", torch::nn::BatchNorm3d(2).ptr()}}));
  }
  torch::nn::Sequential seq{nullptr};
  torch::nn::ModuleList list{nullptr};
  torch::nn::ModuleDict dict{nullptr};
};
TORCH_MODULE(ContainersNet);

TEST(SyncBatchNorm, ConvertReplacesContainerEntriesSharingTheirTensors) {
  ContainersNet net;
  auto old_weight = net->seq[1]->as<torch::nn::BatchNorm1dImpl>()->weight;
  torch::optim::SGD opt(net->parameters(), 1.0); // made before: must keep working
  EXPECT_EQ(convert_sync_batchnorm(net, ProcessGroup()), 3u);
  auto* sync = net->seq[1]->as<SyncBatchNormImpl>();
  ASSERT_NE(sync, nullptr);
  EXPECT_TRUE(sync->weight.is_same(old_weight));
  EXPECT_NE(net->list[0]->as<SyncBatchNormImpl>(), nullptr);
  EXPECT_NE(net->dict["bn"]->as<SyncBatchNormImpl>(), nullptr);
  size_t sync_children = 0;
  for (const auto& m : net->modules()) {
    sync_children += m->as<SyncBatchNormImpl>() != nullptr ? 1 : 0;
    EXPECT_EQ(m->as<torch::nn::BatchNorm1dImpl>(), nullptr);
  }
  EXPECT_EQ(sync_children, 3u);
  EXPECT_EQ(net->named_parameters().size(), 2u + 2u + 2u + 2u + 2u); // linear, bn, bn, linear, bn
  // The Sequential's forward runs the new layer, and the optimizer reaches it.
  auto y = net->seq->forward(torch::randn({5, 3}));
  (y * y).sum().backward();
  ASSERT_TRUE(sync->weight.grad().defined());
  const auto before = sync->weight.clone();
  opt.step();
  EXPECT_FALSE(torch::equal(before, sync->weight));
}

// A frozen BatchNorm (a fine-tuned backbone's) stays frozen once converted,
// as with PyTorch's convert_sync_batchnorm; a trained one still trains.
TEST(SyncBatchNorm, ConvertKeepsFrozenParametersFrozen) {
  ContainersNet net;
  auto* frozen = net->seq[1]->as<torch::nn::BatchNorm1dImpl>();
  frozen->weight.set_requires_grad(false);
  frozen->bias.set_requires_grad(false);
  EXPECT_EQ(convert_sync_batchnorm(net, ProcessGroup()), 3u);
  auto* sync = net->seq[1]->as<SyncBatchNormImpl>();
  ASSERT_NE(sync, nullptr);
  EXPECT_FALSE(sync->weight.requires_grad());
  EXPECT_FALSE(sync->bias.requires_grad());
  EXPECT_TRUE(net->list[0]->as<SyncBatchNormImpl>()->weight.requires_grad());
  EXPECT_TRUE(net->list[0]->as<SyncBatchNormImpl>()->bias.requires_grad());
}

struct OuterNetImpl : torch::nn::Module {
  OuterNetImpl() {
    inner = register_module("inner", MemberNet());
  }
  MemberNet inner{nullptr};
};
TORCH_MODULE(OuterNet);

TEST(SyncBatchNorm, ConvertRefusesMemberFieldsNamingThePathAndChangesNothing) {
  MemberNet net;
  EXPECT_ERROR_SAYS(convert_sync_batchnorm(net, ProcessGroup()),
                    "cannot replace 'norm' (torch::nn::BatchNorm1dImpl), a member of the model",
                    "Declare this one as lockstep::SyncBatchNorm", "Nothing was converted");
  EXPECT_NE(net->body[1]->as<torch::nn::BatchNorm1dImpl>(), nullptr); // the convertible one is untouched too
  OuterNet outer;
  EXPECT_ERROR_SAYS(convert_sync_batchnorm(outer, ProcessGroup()), "cannot replace 'inner.norm'", "a member of 'inner'");
  torch::nn::BatchNorm2d alone(3);
  EXPECT_ERROR_SAYS(convert_sync_batchnorm(alone, ProcessGroup()), "the model itself is a torch::nn::BatchNorm2dImpl");
}

// --- join's checks ---------------------------------------------------------------

TEST(Join, RefusedWithSyncBatchNormAndWithAHookDividingByTheTrainingRanks) {
  torch::nn::Sequential net(torch::nn::Linear(3, 2), SyncBatchNorm(torch::nn::BatchNormOptions(2)));
  DistributedDataParallel<torch::nn::Sequential> ddp(net, ProcessGroup());
  EXPECT_ERROR_SAYS(ddp->join(), "'1' is a lockstep::SyncBatchNorm", "cannot take part in them");
  torch::nn::Sequential plain(torch::nn::Linear(3, 2));
  DistributedDataParallel<torch::nn::Sequential> hooked(plain, ProcessGroup(), DistributedOptions().comm_hook(comm_hooks::allreduce));
  EXPECT_ERROR_SAYS(hooked->join(JoinOptions().divide_by_initial_world_size(false)), "a comm hook is set");
  {
    auto unwound = hooked->join(); // destroyed without finish(): only leaves join mode
  }
  auto guard = hooked->join(); // the default divisor is fine with a hook
  EXPECT_ERROR_SAYS(hooked->join(), "already joined");
  guard.finish();
  EXPECT_ERROR_SAYS(guard.finish(), "already finished");
}

// --- the desync report ------------------------------------------------------------

nlohmann::json entry(int64_t seq, const std::string& op, int64_t numel, const std::string& state) {
  nlohmann::json c = {{"seq", seq}, {"op", op}, {"arg", op == "allreduce" ? "sum" : ""}, {"dtype", "Float"},
                      {"numel", numel}, {"what", op}, {"state", state}};
  c[state == "started" ? "waited_ms" : "duration_ms"] = 3000.0;
  return c;
}

nlohmann::json record(const std::vector<nlohmann::json>& collectives, int64_t issued) {
  return {{"groups", {{{"issued", issued}, {"collectives", collectives}}}}};
}

TEST(DesyncReport, NamesTheFirstCollectiveWhereRanksPart) {
  const auto agreed = entry(0, "allreduce", 8, "completed");
  // Rank 1 ran a barrier where rank 0 ran an allreduce.
  auto lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "failed")}, 2)},
                                     {1, record({agreed, entry(1, "barrier", 0, "failed")}, 2)}},
                                    {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 0 ran allreduce (sum) of 4 Float as #1 where rank 1 ran barrier: the ranks issued "
                      "different collectives from here on.");
  // Rank 2 stopped issuing after #0; ranks 0 and 1 waited in #1.
  lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)},
                                {1, record({agreed, entry(1, "allreduce", 4, "started")}, 2)},
                                {2, record({agreed}, 1)}},
                               {0, 1, 2});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 2 never started collective #1 (allreduce (sum) of 4 Float); ranks 0 and 1 waited 3.0 s in it.");
  // Rank 1 wrote nothing: where rank 0 waited is what it never joined.
  lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)}}, {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("rank 0 waited 3.0 s in collective #1 (allreduce (sum) of 4 Float), which rank 1 never joined"),
            std::string::npos) << lines[0];
  // Everyone there and agreeing, but stuck: the transport.
  lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)},
                                {1, record({agreed, entry(1, "allreduce", 4, "started")}, 2)}},
                               {0, 1});
  EXPECT_NE(lines[0].find("every rank started collective #1"), std::string::npos) << lines[0];
  // The same number of values in another shape: no agreement, and the shapes told.
  auto flat = entry(1, "allreduce", 4, "failed"), square = flat;
  flat["shape"] = {4};
  square["shape"] = {2, 2};
  lines = tools::desync_report({{0, record({agreed, flat}, 2)}, {1, record({agreed, square}, 2)}}, {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 0 ran allreduce (sum) of 4 Float shaped [4] as #1 where rank 1 ran allreduce (sum) of 4 "
                      "Float shaped [2,2]: the ranks issued different collectives from here on.");
  EXPECT_TRUE(tools::desync_report(std::map<int, nlohmann::json>{}, {0, 1}).empty());
}

// Rank 1 stopped at #5; rank 0 went on to #11, and its buffer of two kept
// only #10 and #11. The report named #10, the first collective both
// records could speak of, as the one rank 1 never started.
TEST(DesyncReport, ARankThatStoppedBeforeWhatTheOthersRememberIsNamedWithItsNumber) {
  const auto lines = tools::desync_report(
      {{0, record({entry(10, "allreduce", 4, "completed"), entry(11, "allreduce", 4, "started")}, 12)},
       {1, record({entry(3, "allreduce", 4, "completed"), entry(4, "allreduce", 4, "completed")}, 5)}},
      {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 1 never started collective #5, which the other ranks' flight records no longer hold: "
                      "they went on past it. Run again with a larger LOCKSTEP_TRACE_BUFFER_SIZE to see which "
                      "collective it was.");
}

// --- command-line checks (common/cli_checks.h) ------------------------------------

// The message CLI11 gives for `value` on an option checked by `check`; empty if it takes it.
std::string refusal(const CLI::Validator& check, const std::string& value) {
  CLI::App app;
  double number = 0;
  app.add_option("--n", number)->check(check);
  const char* argv[] = {"prog", "--n", value.c_str()};
  try {
    app.parse(3, argv);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(CliChecks, RefusalsSayWhatIsWrongInWords) {
  EXPECT_EQ(refusal(common::positive(), "0"), "--n: must be greater than 0, got 0");
  EXPECT_EQ(refusal(common::positive(), "-2.5"), "--n: must be greater than 0, got -2.5");
  EXPECT_EQ(refusal(common::positive(), "1e5000"), "--n: expected a number greater than 0, got '1e5000'");
  EXPECT_EQ(refusal(common::positive(), "inf"), "--n: expected a number greater than 0, got 'inf'");
  EXPECT_EQ(refusal(common::positive(), "abc"), "--n: expected a number greater than 0, got 'abc'");
  EXPECT_EQ(refusal(common::positive(), "0.001"), "");
  EXPECT_EQ(refusal(common::non_negative(), "-1"), "--n: must be 0 or more, got -1");
  EXPECT_EQ(refusal(common::non_negative(), "nan"), "--n: expected a number 0 or more, got 'nan'");
  EXPECT_EQ(refusal(common::non_negative(), "0"), "");
}

TEST(CliChecks, LauncherRefusesANegativeNodeRankInWords) {
  const char* argv[] = {"lockstep-run", "--node-rank", "-1", "prog"};
  try {
    tools::parse_run_options(4, argv);
    ADD_FAILURE() << "--node-rank -1 was accepted";
  } catch (const tools::RunUsageError& e) {
    EXPECT_EQ(e.exit_code, common::kUsageError);
    EXPECT_NE(std::string(e.what()).find("--node-rank: must be 0 or more, got -1"), std::string::npos) << e.what();
  }
}

// A write the disk refuses (here the file-size limit, as a full disk would)
// is an error that names the file, and leaves the old file as it was and
// no partial temporary file to hold the space the next save needs.
TEST(CheckedFile, AWriteTheDiskRefusesLeavesTheOldFileAndNoTemporary) {
  namespace fs = std::filesystem;
  const auto dir = testing::scratch("checked_file");
  fs::create_directories(dir);
  const auto path = dir + "/state.bin";
  detail::write_checked_file(path, "MAGIC\n", "old", "writer");
  const auto old_size = fs::file_size(path);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 4096;
  const auto handler = std::signal(SIGXFSZ, SIG_IGN); // else the kernel's signal ends the process
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const auto message = testing::error_of([&] {
    detail::write_checked_file(path, "MAGIC\n", std::string(1 << 20, 'x'), "writer");
  });
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, handler);
  EXPECT_NE(message.find("writer: cannot write " + path + ".tmp."), std::string::npos) << message;
  EXPECT_EQ(fs::file_size(path), old_size);
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename(), "state.bin") << "left behind";
  }
}

// Note [The wheel's std::filesystem]: folders are removed with nftw.
TEST(RemoveTree, RemovesNestedFoldersButNotWhatALinkPointsTo) {
  namespace fs = std::filesystem;
  const auto root = testing::scratch("remove_tree");
  const auto outside = root + "_outside";
  ASSERT_TRUE(detail::remove_tree(root));
  ASSERT_TRUE(detail::remove_tree(outside));
  fs::create_directories(root + "/a/b");
  fs::create_directories(outside);
  std::ofstream(root + "/a/b/file") << "x";
  std::ofstream(root + "/top") << "y";
  std::ofstream(outside + "/kept") << "z";
  fs::create_directory_symlink(outside, root + "/a/link");
  EXPECT_TRUE(detail::remove_tree(root));
  EXPECT_FALSE(fs::exists(root));
  EXPECT_TRUE(fs::exists(outside + "/kept")) << "followed a link out of the folder";
  EXPECT_TRUE(detail::remove_tree(root)) << "nothing there is not an error";
  std::ofstream(root) << "a file";
  EXPECT_TRUE(detail::remove_tree(root));
  EXPECT_FALSE(fs::exists(root));
  EXPECT_TRUE(detail::remove_tree(outside));
}

} // namespace
} // namespace lockstep
