// The launcher's environment, parsed as a pure function (torchrun's and MPI
// launchers' variables, LOCKSTEP_TIMEOUT, the store file), and where a
// server listens for the address it is named by.

#include "../src/comm/launch_env.h"
#include <common/sockets.h>
#include <lockstep/process_group.h>

#include "../src/comm/store.h"
#include "support/errors.h"
#include "support/scratch.h"

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
#include <string>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <sys/resource.h>
#include <unistd.h>

namespace lockstep {
namespace {

using testing::error_of;

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

// Under mpirun, ProcessGroupOptions giving the world size alone turned
// Open MPI's variables off, and the error asked for torchrun's RANK.
TEST(LaunchEnv, HalfOfRankAndWorldSizeUnderAnMpiLauncherSaysWhy) {
  const auto mpi = env_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().world_size(2), mpi),
                    "started by Open MPI's mpirun (OMPI_COMM_WORLD_RANK=1), but only the world size is given",
                    "Give both in ProcessGroupOptions, or neither");
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().rank(1), mpi), "only the rank is given");
  const auto env = detail::parse_launch_env(ProcessGroupOptions().rank(1).world_size(2).master_addr("127.0.0.1")
                                                .master_port(29500), mpi);
  EXPECT_EQ(env.rank, 1);
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

// A value given in the options that is neither "unset" nor in range is
// refused by its name: a world_size of 0 was read as unset (and the error
// then named $WORLD_SIZE), one of 2^32 + 2 became 2.
TEST(LaunchEnv, OptionsOutOfRangeNameThemselves) {
  const auto vars = env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}});
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().world_size(0), vars),
                    "ProcessGroupOptions::world_size is 0; expected 1 to 1048576 processes, or -1");
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().world_size(4294967298LL).rank(0), vars),
                    "ProcessGroupOptions::world_size is 4294967298");
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().rank(-2), vars),
                    "ProcessGroupOptions::rank is -2; expected 0 <= rank < world_size, or -1");
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().master_port(-1), vars),
                    "ProcessGroupOptions::master_port is -1; expected a port number from 1 to 65535, or 0");
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions().world_size(2).rank(1), vars).rank, 1);
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
  vars["LOCKSTEP_TIMEOUT"] = "604801"; // a number, past the bound that the error must then give
  message = error_of([&] { detail::parse_launch_env(ProcessGroupOptions(), env_of(vars)); });
  EXPECT_NE(message.find("LOCKSTEP_TIMEOUT=\"604801\" is malformed; expected whole seconds from 1 to 604800 (a week)"),
            std::string::npos) << message;
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
  // A null store was dereferenced: a crash.
  message = error_of([&] { new_group(c10::intrusive_ptr<c10d::Store>(), 0, 2, "gloo"); });
  EXPECT_NE(message.find("new_group: the store is null, and the gloo backend meets through one"), std::string::npos)
      << message;
}

// How many ranks share this host decides how Open MPI copies between them
// (Note [MPI's copies on a full host]); unknown is 0, never an error.
TEST(LaunchEnv, MpiRanksOnThisHostAreTheLaunchersLocalSizeElseItsWorldSize) {
  EXPECT_EQ(detail::mpi_ranks_on_this_host(env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})), 2);
  EXPECT_EQ(detail::mpi_ranks_on_this_host(env_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "3"}})), 3);
  EXPECT_EQ(detail::mpi_ranks_on_this_host(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"},
                                                   {"SLURM_NTASKS_PER_NODE", "2(x3)"}, {"SLURM_STEP_ID", "0"}})), 0);
  EXPECT_EQ(detail::mpi_ranks_on_this_host(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}})), 0);
}

// A rank's GPU is its local rank's: under mpirun --map-by node, ranks 0, 2,
// 4 and 6 share a host, and rank % 4 would put two of them on GPU 0 and two
// on GPU 2.
TEST(LaunchEnv, TheLocalRankIsTheLaunchersThatGaveTheRank) {
  EXPECT_EQ(detail::local_rank_of(env_of({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}})), 2);
  EXPECT_EQ(detail::local_rank_of(env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                                          {"SLURM_STEP_ID", "0"}})), 1);
  EXPECT_EQ(detail::local_rank_of(env_of({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "3"}})), 3);
  // torchrun's variables win over an MPI launcher's, as they do for the rank.
  EXPECT_EQ(detail::local_rank_of(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                          {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}})), 1);
  EXPECT_EQ(detail::local_rank_of(env_of({{"LOCAL_RANK", "3"}})), 3); // DeepSpeed's, hand-written scripts
  EXPECT_EQ(detail::local_rank_of(env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}})), -1);
  EXPECT_EQ(detail::local_rank_of(env_of({})), -1);
  const std::string message = error_of([] { detail::local_rank_of(env_of({{"LOCAL_RANK", "gpu1"}})); });
  EXPECT_NE(message.find("LOCAL_RANK"), std::string::npos) << message;
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
  // torchrun's variables win over a launcher's, where torchrun (or
  // lockstep-run) set them: `srun torchrun ...`.
  env = detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                                                  {"TORCHELASTIC_RUN_ID", "none"},
                                                                  {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  EXPECT_EQ(env.mpi_launcher, nullptr);
  EXPECT_EQ(env.world_size, 1);
  auto message = error_of([] {
    detail::parse_launch_env(ProcessGroupOptions(), env_of({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  });
  EXPECT_NE(message.find("OMPI_COMM_WORLD_RANK=\"4\" is malformed"), std::string::npos) << message;
}

// RANK=0 and WORLD_SIZE=1 left in the shell made every process of
// `mpirun -np 2` rank 0 of a job of one: two jobs, each training alone.
TEST(LaunchEnv, StaleRankAndWorldSizeUnderAnMpiLauncherAreRefused) {
  const std::map<std::string, std::string> mpirun{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                                  {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto with = [&](std::map<std::string, std::string> more) {
    more.insert(mpirun.begin(), mpirun.end());
    return env_of(more);
  };
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions(), with({{"RANK", "0"}, {"WORLD_SIZE", "1"}})),
                    "rank 0 of 1 (RANK and WORLD_SIZE from the environment) cannot be a launch inside Open MPI's "
                    "mpirun, which started this process as rank 1 of 2 (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)",
                    "Unset RANK and WORLD_SIZE");
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions(), with({{"RANK", "0"}, {"WORLD_SIZE", "2"}})),
                    "rank 0 of 2 (RANK and WORLD_SIZE from the environment)");
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions().world_size(2), with({{"RANK", "0"}})),
                    "rank 0 of 2 (RANK from the environment, the world size from ProcessGroupOptions)");
  // The launcher's own values, a larger world (a launcher inside it, or
  // ranks started by hand in an interactive Slurm step), torchrun's or
  // lockstep-run's numbering, and values the caller passes, stand.
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), with({{"RANK", "1"}, {"WORLD_SIZE", "2"}})).rank, 1);
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), with({{"RANK", "0"}, {"WORLD_SIZE", "8"}})).world_size, 8);
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"},
                                                                     {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"},
                                                                     {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "127.0.0.1"},
                                                                     {"MASTER_PORT", "29500"}})).rank, 1);
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), with({{"RANK", "0"}, {"WORLD_SIZE", "2"},
                                                                   {"TORCHELASTIC_RUN_ID", "job"}})).rank, 0);
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions().rank(0).world_size(1), with({{"RANK", "0"},
                                                                                        {"WORLD_SIZE", "1"}})).world_size, 1);
  // Slurm's variables count only inside a step; a batch script's are no launcher's.
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                                                     {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}})).world_size, 1);
  EXPECT_ERROR_SAYS(detail::parse_launch_env(ProcessGroupOptions(), env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                                                            {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"},
                                                                            {"SLURM_STEP_ID", "0"}})),
                    "Slurm's srun, which started this process as rank 3 of 4");
}

// A job's MASTER_ADDR without MASTER_PORT (a Slurm script's, say) made
// every rank under mpirun fail, asking for a port the mpi backend never uses.
TEST(LaunchEnv, AnMpiJobWithAnAddressButNoPortNeedsAPortOnlyForAStore) {
  const std::map<std::string, std::string> vars{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                                {"MASTER_ADDR", "127.0.0.1"}};
  const auto env = detail::parse_launch_env(ProcessGroupOptions(), env_of(vars));
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.master_port, 0);
  EXPECT_EQ(detail::parse_launch_env(ProcessGroupOptions().master_port(29500), env_of(vars)).master_port, 29500);
  // Gloo does need the store: init_process_group says which variable is missing.
  for (const auto& [name, value] : vars) {
    ASSERT_EQ(setenv(name.c_str(), value.c_str(), 1), 0);
  }
  const auto message = error_of([] { init_process_group(ProcessGroupOptions().backend("gloo")); });
  for (const auto& [name, value] : vars) {
    unsetenv(name.c_str());
  }
  EXPECT_NE(message.find("rank 0: started by Open MPI's mpirun, the gloo backend needs a store, and MASTER_PORT is "
                         "not set"), std::string::npos) << message;
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

} // namespace
} // namespace lockstep
