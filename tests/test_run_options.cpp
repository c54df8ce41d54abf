// lockstep-run's command line as pure logic: torchrun's flags and their
// elastic forms, and the values a Slurm step gives (tools/run_options.h).

#include <common/process_files.h>
#include <tools/run_options.h>

#include "support/scoped_env.h"
#include "support/scratch.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace lockstep {
namespace {

// --- the command line ---------------------------------------------------------

tools::RunOptions parse(std::vector<std::string> args) {
  args.insert(args.begin(), "lockstep-run");
  args.push_back("prog");
  std::vector<const char*> argv;
  for (const auto& a : args) {
    argv.push_back(a.c_str());
  }
  return tools::parse_run_options(static_cast<int>(argv.size()), argv.data());
}

std::string refusal(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const tools::RunUsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(ElasticOptions, TorchrunsFlagsInBothSpellingsMakeAnElasticJob) {
  const auto o = parse({"--nnodes", "2:4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "node0:1234", "--rdzv_id", "job7",
                        "--rdzv_conf", "join_timeout=20,last_call_timeout=0.5,keep_alive_interval=1,keep_alive_max_attempt=4",
                        "--monitor_interval", "0.2"});
  EXPECT_TRUE(o.elastic());
  EXPECT_EQ(o.min_nodes, 2);
  EXPECT_EQ(o.nnodes, 4);
  EXPECT_EQ(o.rdzv_host, "node0");
  EXPECT_EQ(o.rdzv_port, 1234);
  EXPECT_EQ(o.rdzv_id, "job7");
  EXPECT_EQ(o.join_timeout, 20);
  EXPECT_EQ(o.last_call_timeout, 0.5);
  EXPECT_EQ(o.keep_alive_interval, 1);
  EXPECT_EQ(o.keep_alive_max_attempt, 4);
  const auto range = parse({"--nnodes", "1:2", "--rdzv-endpoint", "[::1]"});
  EXPECT_TRUE(range.elastic()) << "a range means c10d";
  EXPECT_EQ(range.rdzv_host, "::1");
  EXPECT_EQ(range.rdzv_port, 29400);
  EXPECT_FALSE(parse({"--nnodes", "2", "--master-addr", "h"}).elastic());
}

// torchrun's static form with an endpoint: the nodes keep the numbers
// given them, and meet at the endpoint. It became an elastic job whose
// nodes were numbered as they joined, ignoring --node-rank (Note
// [--node-rank and the rendezvous]); without a backend it is refused.
TEST(ElasticOptions, AStaticJobAtAnEndpointKeepsItsNodeRank) {
  const auto o = parse({"--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static", "--rdzv-endpoint",
                        "node0:29555"});
  EXPECT_FALSE(o.elastic());
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "node0");
  EXPECT_EQ(o.master_port, 29555);
  // Given beside --master-addr (or Slurm's default one), the endpoint wins, as under torchrun, saying so.
  const auto both = parse({"--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static", "--rdzv-endpoint",
                           "node0:29555", "--master-addr", "other"});
  EXPECT_EQ(both.master_addr, "node0");
  EXPECT_EQ(both.master_port, 29555);
  ASSERT_EQ(both.notes.size(), 1u);
  EXPECT_EQ(both.notes[0], "a static job with --rdzv-endpoint meets there, as torchrun's: at node0:29555, not at the "
                           "master address other:29500.");
  const auto conf = parse({"--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", "--rdzv-conf", "timeout=900"});
  EXPECT_EQ(conf.notes, std::vector<std::string>{"--rdzv-conf has no effect in a static job: its nodes wait --timeout "
                                                 "for each other."});
  EXPECT_NE(refusal({"--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29555"}).find(
                "--node-rank 1 with --rdzv-endpoint: by default the nodes meet in c10d rounds"),
            std::string::npos);
  EXPECT_TRUE(parse({"--nnodes", "2", "--rdzv-endpoint", "node0"}).elastic()) << "without --node-rank, c10d";
  EXPECT_TRUE(parse({"--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0"})
                  .elastic()) << "an explicit c10d numbers the nodes as they join, as torchrun's";
  EXPECT_NE(refusal({"--nnodes", "1:2", "--rdzv-backend", "static", "--rdzv-endpoint", "h"}).find(
                "is a range of nodes, which the static rendezvous cannot take"),
            std::string::npos);
}

TEST(ElasticOptions, BadElasticCommandLinesSayWhatIsWrong) {
  EXPECT_EQ(refusal({"--nnodes", "1:2"}), "--nnodes 1:2 needs --rdzv-endpoint HOST[:PORT]: the address of the node that "
                                          "serves the rendezvous, which every node can reach.");
  EXPECT_EQ(refusal({"--nnodes", "3:2", "--rdzv-endpoint", "h"}), "--nnodes 3:2: MIN is above MAX; expected MIN:MAX with MIN <= MAX.");
  EXPECT_EQ(refusal({"--nnodes", "0:2"}), "--nnodes 0:2: '0' is not a whole number from 1 to 65536.");
  EXPECT_EQ(refusal({"--nnodes", "two"}), "--nnodes two: 'two' is not a whole number from 1 to 65536.");
  EXPECT_EQ(refusal({"--rdzv-backend", "etcd"}), "--rdzv-backend etcd is not supported; lockstep-run has static and c10d.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h:99999"}), "--rdzv-endpoint h:99999: port '99999' is not a port number (1 to 65535).");
  EXPECT_EQ(refusal({"--rdzv-endpoint", ":5"}), "--rdzv-endpoint :5 has no host; expected HOST[:PORT].");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "wait=5"}),
            "--rdzv-conf wait=5: unknown key; expected join_timeout (or timeout), last_call_timeout, "
            "keep_alive_interval (or heartbeat), keep_alive_max_attempt, read_timeout, is_host, store_type, or "
            "torchrun's close_timeout, heartbeat_timeout or cas_backoff_max_seconds (accepted, no effect).");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "join_timeout=-1"}),
            "--rdzv-conf join_timeout=-1: expected a number of seconds above 0 and at most 604800 (7 days).");
  // A space split the store's "ADD KEY VALUE" line: the job ended naming a lost store.
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-id", "my run"}),
            "--rdzv-id 'my run' holds a space or a control character; use letters, digits and punctuation.");
  // Beats come from the monitor loop: one slower than half the liveness
  // window lost live nodes; a keep-alive under 1 ms was truncated to 0.
  EXPECT_NE(refusal({"--rdzv-endpoint", "h", "--monitor-interval", "20"}).find(
                "--monitor-interval 20 is more than half the liveness window (15 s"), std::string::npos);
  EXPECT_NE(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "keep_alive_interval=0.0004"}).find(
                "keep_alive_interval=0.000400 is below 1 ms"), std::string::npos);
}

// torchrun's forms that lockstep-run does not take say what to write
// instead: -m (a Python module), and a script in the current directory,
// which torchrun runs with python and a shell only as ./NAME.
TEST(RunOptions, TorchrunsPythonFormsSayWhatToWriteInstead) {
  EXPECT_EQ(refusal({"-m", "pkg.train"}), "-m runs a Python module under torchrun; lockstep-run runs a program as "
                                          "given (as torchrun --no-python does): name the interpreter, as in "
                                          "`lockstep-run ... python3 -m MODULE`.");
  using common::InThisDirectory;
  EXPECT_EQ(common::program_missing_message("train", InThisDirectory::kProgram),
            "program 'train' not found in PATH or not executable. ./train is in this directory: lockstep-run runs "
            "PROGRAM as a shell would (as torchrun --no-python does), so write ./train.");
  EXPECT_EQ(common::program_missing_message("train.py", InThisDirectory::kNothing),
            "program 'train.py' not found in PATH or not executable. A Python script needs its interpreter: "
            "lockstep-run ... python3 train.py.");
  EXPECT_EQ(common::program_missing_message("bin/train", InThisDirectory::kProgram),
            "program 'bin/train' not found or not executable.");
  // A folder, or a file that is not executable, is no program to write ./ before.
  EXPECT_EQ(common::program_missing_message("data", InThisDirectory::kFolder),
            "program 'data' not found in PATH or not executable.");
  EXPECT_EQ(common::program_missing_message("train", InThisDirectory::kNotExecutable),
            "program 'train' not found in PATH or not executable. ./train is in this directory but not executable: "
            "make it so (chmod +x train) and write ./train, or name the program that runs it.");
  const auto dir = testing::scratch("in_this_directory");
  std::filesystem::create_directories(dir);
  EXPECT_EQ(common::in_this_directory(dir), InThisDirectory::kFolder);
  std::ofstream(dir + "/script") << "#!/bin/sh\n";
  EXPECT_EQ(common::in_this_directory(dir + "/script"), InThisDirectory::kNotExecutable);
  ::chmod((dir + "/script").c_str(), 0755);
  EXPECT_EQ(common::in_this_directory(dir + "/script"), InThisDirectory::kProgram);
  EXPECT_EQ(common::in_this_directory(dir + "/none"), InThisDirectory::kNothing);
}

// Kubeflow's PyTorchJob gives each pod's torchrun only PET_ variables
// (Note [torchrun's PET_ variables]): without them every pod ran a job of
// its own. The command line wins.
TEST(RunOptions, TorchrunsPetVariablesFillWhatTheCommandLineLeaves) {
  const std::vector<std::pair<std::string, std::string>> pet{
      {"PET_NNODES", "2"}, {"PET_NODE_RANK", "1"}, {"PET_MASTER_ADDR", "pod-0"}, {"PET_MASTER_PORT", "23456"},
      {"PET_NPROC_PER_NODE", "3"}};
  for (const auto& [name, value] : pet) {
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  const auto options = parse({});
  const auto overridden = parse({"--nproc-per-node", "2", "--master-port", "29501"});
  for (const auto& [name, value] : pet) {
    ::unsetenv(name.c_str());
  }
  EXPECT_EQ(options.nnodes, 2);
  EXPECT_EQ(options.node_rank, 1);
  EXPECT_EQ(options.master_addr, "pod-0");
  EXPECT_EQ(options.master_port, 23456);
  EXPECT_EQ(options.nproc_per_node, 3);
  EXPECT_EQ(overridden.nproc_per_node, 2);
  EXPECT_EQ(overridden.master_port, 29501);
  EXPECT_EQ(overridden.master_addr, "pod-0");
}

// A bad PET_ value was refused under the flag's name, which the command
// line did not hold.
TEST(RunOptions, ARefusedPetVariableIsNamed) {
  std::string restarts, given, nproc;
  {
    testing::ScopedEnv nproc_env("PET_NPROC_PER_NODE", "zz");
    {
      testing::ScopedEnv restarts_env("PET_MAX_RESTARTS", "x");
      restarts = refusal({});
      given = refusal({"--max-restarts", "y"});
    }
    nproc = refusal({});
  }
  EXPECT_EQ(restarts.rfind("--max-restarts (from PET_MAX_RESTARTS): ", 0), 0u) << restarts;
  EXPECT_EQ(given.rfind("--max-restarts: ", 0), 0u) << given;
  EXPECT_EQ(nproc.rfind("--nproc-per-node (from PET_NPROC_PER_NODE) zz: expected a number of ranks", 0), 0u) << nproc;
  // PROGRAM's own arguments are not lockstep-run's; refusals after parsing
  // (the GPUs, the filter) name the variable too.
  testing::ScopedEnv filter("PET_LOCAL_RANKS_FILTER", "5");
  const char* argv[] = {"lockstep-run", "--nproc-per-node", "2", "python3", "t.py", "--local_ranks_filter", "0"};
  auto options = tools::parse_run_options(7, argv);
  std::string filtered;
  tools::check_local_ranks_filter(options, [&](const std::string& message) {
    filtered = tools::name_pet_source(message, 7, argv);
  });
  EXPECT_EQ(filtered.rfind("--local-ranks-filter (from PET_LOCAL_RANKS_FILTER) 5 names no rank of this node", 0), 0u)
      << filtered;
}

// --- lockstep-run under srun (Note [lockstep-run under srun]) ----------------

TEST(SlurmStep, FirstHostOfANodeList) {
  EXPECT_EQ(tools::first_host("node[01-04,07],gpu3"), "node01");
  EXPECT_EQ(tools::first_host("node[0-1]"), "node0");
  EXPECT_EQ(tools::first_host("rack[1-2]-n[5-6]"), "rack1-n5");
  EXPECT_EQ(tools::first_host("alpha,beta"), "alpha");
  EXPECT_EQ(tools::first_host("solo"), "solo");
  EXPECT_EQ(tools::first_host("n[7]"), "n7");
}

tools::RunOptions parse_with(std::vector<std::string> args, const std::map<std::string, std::string>& env) {
  args.insert(args.begin(), "lockstep-run");
  args.push_back("prog");
  std::vector<const char*> argv;
  for (const auto& a : args) {
    argv.push_back(a.c_str());
  }
  return tools::parse_run_options(static_cast<int>(argv.size()), argv.data(), [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

const std::map<std::string, std::string> kStepOnNode1{{"SLURM_STEP_ID", "0"}, {"SLURM_NNODES", "2"},
                                                      {"SLURM_NODEID", "1"}, {"SLURM_NTASKS", "2"},
                                                      {"SLURM_JOB_NODELIST", "node[0-1]"}};

TEST(SlurmStep, NodeCountNodeRankAndMasterComeFromTheStep) {
  const auto o = parse_with({"--nproc-per-node", "2"}, kStepOnNode1);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "node0");
  EXPECT_FALSE(o.elastic());
  const auto given = parse_with({"--nnodes", "1", "--node-rank", "0", "--master-addr", "10.0.0.9"}, kStepOnNode1);
  EXPECT_EQ(given.nnodes, 1) << "the command line wins";
  EXPECT_EQ(given.node_rank, 0);
  EXPECT_EQ(given.master_addr, "10.0.0.9");
  auto batch = kStepOnNode1; // a batch script: no step
  batch.erase("SLURM_STEP_ID");
  const auto alone = parse_with({}, batch);
  EXPECT_EQ(alone.nnodes, 1);
  EXPECT_EQ(alone.master_addr, "127.0.0.1");
}

// `lockstep-run --nnodes 1 ...` in a step of 2 nodes said "--node-rank 1 is
// out of range for --nnodes 1", a flag nobody gave; and --standalone was
// overridden by the step's values, silently.
TEST(SlurmStep, ANodeRankFromTheStepNamesSlurmAndStandaloneIgnoresTheStep) {
  const std::map<std::string, std::string> step{{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_NODES", "2"},
                                                {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_NODEID", "1"},
                                                {"SLURM_STEP_NODELIST", "localhost"}};
  try {
    parse_with({"--nnodes", "1"}, step);
    ADD_FAILURE() << "node 1 of the step was accepted as a node of --nnodes 1";
  } catch (const tools::RunUsageError& e) {
    EXPECT_STREQ(e.what(), "SLURM_NODEID=1 (this node's index in the srun step of 2 node(s)) is lockstep-run's default "
                           "--node-rank, and it is out of range for --nnodes 1. Under srun, leave --nnodes out (it is "
                           "then the step's node count) or give the step's 2; for a job of this node alone on each "
                           "machine, pass --standalone.");
  }
  EXPECT_NE(std::string(refusal({"--nnodes", "2", "--node-rank", "2", "--master-addr", "h"})).find(
                "--node-rank 2 is out of range for --nnodes 2"), std::string::npos) << "a --node-rank given stays named";
  const auto alone = parse_with({"--standalone", "--nproc-per-node", "2"}, step);
  EXPECT_EQ(alone.nnodes, 1);
  EXPECT_EQ(alone.node_rank, 0);
  EXPECT_EQ(alone.master_addr, "127.0.0.1");
  auto more_tasks = step;
  more_tasks["SLURM_STEP_NUM_TASKS"] = "4";
  EXPECT_EQ(parse_with({"--standalone"}, more_tasks).nnodes, 1) << "each task its own job of one node";
}

// Note [The rendezvous's id]: an elastic job's nodes meet under --rdzv-id,
// else Slurm's job and step, else no id (their programs tell jobs apart).
TEST(SlurmStep, AnElasticJobsRendezvousIdIsSlurmsJobAndStepWithoutRdzvId) {
  const std::map<std::string, std::string> step{{"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "3"}};
  EXPECT_EQ(parse_with({"--nnodes", "1:2", "--rdzv-endpoint", "h"}, step).rdzv_job, "slurm-77.3");
  EXPECT_EQ(parse_with({"--nnodes", "1:2", "--rdzv-endpoint", "h", "--rdzv-id", "mine"}, step).rdzv_job, "mine");
  EXPECT_EQ(parse_with({"--nnodes", "1:2", "--rdzv-endpoint", "h"}, {}).rdzv_job, "");
  EXPECT_EQ(parse_with({"--nnodes", "1:2", "--rdzv-endpoint", "h"}, {{"SLURM_JOB_ID", "77"}}).rdzv_job, "slurm-77");
}

// lockstep-train's default folder is runs/<run id>, where a restart finds
// its checkpoint: two jobs with one id train on from each other's.
TEST(SlurmStep, TwoJobsNeverShareARunId) {
  using Vars = std::map<std::string, std::string>;
  const auto id = [](const Vars& vars, long pid, int nnodes) {
    return tools::default_run_id([&vars](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    }, "20261126-120000", pid, nnodes);
  };
  EXPECT_EQ(id({{"LOCKSTEP_RUN_ID", "mine"}, {"SLURM_JOB_ID", "77"}}, 1, 1), "mine");
  EXPECT_EQ(id({{"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "2"}}, 1, 1), "slurm-77.2");
  EXPECT_NE(id({{"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "3"}}, 1, 1), "slurm-77.2") << "two sruns of one allocation";
  EXPECT_EQ(id({{"SLURM_JOB_ID", "77"}}, 1, 1), "slurm-77") << "a batch script's own step";
  EXPECT_NE(id({}, 100, 1), id({}, 101, 1)) << "two launches on one machine in the same second";
  EXPECT_EQ(id({}, 100, 2), id({}, 101, 2)) << "the nodes of a job share only the time";
  const auto with_rdzv_id = [](const char* name) -> const char* {
    return std::string(name) == "SLURM_JOB_ID" ? "77" : std::string(name) == "LOCKSTEP_RUN_ID" ? "env" : nullptr;
  };
  EXPECT_EQ(tools::default_run_id(with_rdzv_id, "20261126-120000", 1, 2, "job-9"), "job-9")
      << "--rdzv-id, as torchrun's users give every node";
  // A static node checks node 0's job id against its own only where both
  // ids are ones the whole job shares; a start time, even one given as
  // LOCKSTEP_RUN_ID, is the id's source that says so, not its text.
  const auto shared = [](const Vars& vars, const std::string& rdzv_id) {
    return tools::run_id_shared([&vars](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    }, rdzv_id);
  };
  EXPECT_TRUE(shared({}, "job-9"));
  EXPECT_TRUE(shared({{"LOCKSTEP_RUN_ID", "20261126-120000"}}, ""));
  EXPECT_TRUE(shared({{"SLURM_JOB_ID", "77"}}, ""));
  EXPECT_FALSE(shared({}, ""));
  EXPECT_FALSE(shared({{"LOCKSTEP_RUN_ID", ""}}, ""));
}

TEST(SlurmStep, MoreTasksThanNodesIsAClearError) {
  auto step = kStepOnNode1;
  step["SLURM_NTASKS"] = "4";
  try {
    parse_with({}, step);
    ADD_FAILURE() << "4 tasks on 2 nodes were accepted";
  } catch (const tools::RunUsageError& e) {
    EXPECT_STREQ(e.what(), "under srun, lockstep-run starts each node's ranks itself, so it runs once per node (srun "
                           "--ntasks-per-node=1 lockstep-run --nproc-per-node N ...); this step has 4 tasks on 2 node(s).");
  }
}

// --- torchrun's flags (Note [torchrun's flags] in tools/run_options.h) -------------

TEST(ElasticOptions, TorchrunsRdzvConfKeysAreTakenAndBadOnesSayWhatIsAccepted) {
  const auto o = parse({"--rdzv-endpoint", "h", "--rdzv-conf",
                        "timeout=20,heartbeat=1,read_timeout=7,close_timeout=3,is_host=false"});
  EXPECT_EQ(o.join_timeout, 20);
  EXPECT_EQ(o.keep_alive_interval, 1);
  EXPECT_EQ(o.read_timeout, 7);
  EXPECT_EQ(o.is_host, 0);
  ASSERT_EQ(o.notes.size(), 1u);
  EXPECT_EQ(o.notes[0], "--rdzv-conf close_timeout has no effect: a lockstep-run round closes when --nnodes MAX nodes "
                        "joined, or last_call_timeout after MIN did.");
  EXPECT_EQ(parse({"--rdzv-endpoint", "h", "--rdzv-conf", "is_host=1"}).is_host, 1);
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "timeout=5,join_timeout=6"}),
            "--rdzv-conf timeout=5,join_timeout=6: timeout and join_timeout both set join_timeout; give it once.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "heartbeat=1,heartbeat=2"}),
            "--rdzv-conf heartbeat=1,heartbeat=2: keep_alive_interval is given twice; give it once.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "timeout=5,,heartbeat=1"}),
            "--rdzv-conf timeout=5,,heartbeat=1: item 2 is empty; expected KEY=VALUE items separated by single commas.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "timeout=5,"}),
            "--rdzv-conf timeout=5,: item 2 is empty; expected KEY=VALUE items separated by single commas.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "keep_alive_max_attempt=2.5"}),
            "--rdzv-conf keep_alive_max_attempt=2.5: expected a whole count from 1 to 604800.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "read_timeout=999999"}),
            "--rdzv-conf read_timeout=999999: expected a number of seconds above 0 and at most 604800 (7 days).");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "is_host=maybe"}),
            "--rdzv-conf is_host=maybe: expected is_host=true or is_host=false (1 or 0).");
}

// torchrun's c10d rendezvous reads heartbeat_timeout, store_type and
// cas_backoff_max_seconds too (Note [torchrun's --rdzv-conf keys]): its
// command lines are taken, each key with its range checked.
TEST(ElasticOptions, EveryKeyOfTorchrunsC10dRendezvousIsTaken) {
  const auto o = parse({"--rdzv-endpoint", "h", "--rdzv-conf", "join_timeout=20,last_call_timeout=2,close_timeout=3,"
                        "heartbeat_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=5,cas_backoff_max_seconds=0,"
                        "is_host=false,read_timeout=60,store_type=TCP"});
  EXPECT_EQ(o.join_timeout, 20);
  EXPECT_EQ(o.last_call_timeout, 2);
  EXPECT_EQ(o.keep_alive_interval, 1);
  EXPECT_EQ(o.keep_alive_max_attempt, 5);
  EXPECT_EQ(o.read_timeout, 60);
  EXPECT_EQ(o.is_host, 0);
  ASSERT_EQ(o.notes.size(), 3u) << "close_timeout, heartbeat_timeout, cas_backoff_max_seconds";
  EXPECT_EQ(o.notes[1], "--rdzv-conf heartbeat_timeout has no effect: a heartbeat is one store operation, which "
                        "read_timeout bounds as every other.");
  EXPECT_EQ(o.notes[2], "--rdzv-conf cas_backoff_max_seconds has no effect: lockstep-run's rendezvous store counts "
                        "atomically, so no write is retried.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "store_type=file"}),
            "--rdzv-conf store_type=file: lockstep-run's rendezvous store is served over TCP at --rdzv-endpoint, and "
            "it has no file store; drop store_type, or give store_type=tcp.");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "store_type=etcd"}),
            "--rdzv-conf store_type=etcd: expected store_type=tcp (torchrun's default, and lockstep-run's only store).");
  EXPECT_EQ(refusal({"--rdzv-endpoint", "h", "--rdzv-conf", "cas_backoff_max_seconds=-1"}),
            "--rdzv-conf cas_backoff_max_seconds=-1: expected a number of seconds from 0 to 604800 (7 days).");
}

// A --local-addr holding ',' or ';' (the records' separators), whitespace
// or a control character is refused when parsed, naming where it came from.
TEST(ElasticOptions, ALocalAddrThatCannotBeAnAddressIsRefused) {
  for (const std::string bad : {"host;x", "b,x", "a b", "tab\there", "nul\x01"}) {
    EXPECT_EQ(refusal({"--nnodes", "1:2", "--rdzv-endpoint", "h", "--local-addr", bad}),
              "--local-addr '" + bad + "' holds a comma, a semicolon, a space or a control character; give a host "
              "name or an IP address of this machine that the other nodes reach, for example 10.0.0.5.") << bad;
  }
  ::setenv("PET_LOCAL_ADDR", "b,x", 1);
  const std::string from_pet = refusal({"--nnodes", "1:2", "--rdzv-endpoint", "h"});
  ::unsetenv("PET_LOCAL_ADDR");
  EXPECT_EQ(from_pet.rfind("--local-addr (from PET_LOCAL_ADDR) 'b,x' holds a comma", 0), 0u) << from_pet;
  EXPECT_EQ(parse({"--nnodes", "1:2", "--rdzv-endpoint", "h", "--local-addr", "fd00::5"}).local_addr, "fd00::5");
}

TEST(RunOptions, TorchrunsFlagsAreAcceptedAndThoseWithoutEffectSaySo) {
  const auto o = parse({"--standalone", "--no-python", "--nproc-per-node", "auto", "--local-ranks-filter", "0,2",
                        "--tee", "3", "--redirects", "0:1,1:2", "--role", "trainer", "--local_addr", "10.0.0.5"});
  EXPECT_TRUE(o.standalone);
  EXPECT_TRUE(o.no_python);
  EXPECT_EQ(o.nproc_kind, "auto");
  EXPECT_EQ(o.local_ranks_shown, (std::vector<int>{0, 2}));
  EXPECT_EQ(o.role, "trainer");
  ASSERT_EQ(o.notes.size(), 3u);
  EXPECT_EQ(o.notes[0], "--tee has no effect: every rank's stdout and stderr reach the console with a [rank N] "
                        "prefix, and --log-dir's rank_N.log when it is given.");
  EXPECT_EQ(o.notes[1].rfind("--redirects has no effect", 0), 0u) << o.notes[1];
  EXPECT_EQ(o.notes[2], "--local-addr has no effect in a static job: its ranks meet at --master-addr.");
  EXPECT_TRUE(parse({"--nnodes", "1:2", "--rdzv-endpoint", "h", "--local-addr", "10.0.0.5"}).notes.empty())
      << "an elastic node gives the others its --local-addr";
  const auto fail = [](const std::string& message) { throw tools::RunUsageError(message, 2); };
  auto gpu = parse({"--nproc-per-node", "gpu"});
  tools::resolve_nproc_per_node(gpu, 4, 16, fail);
  EXPECT_EQ(gpu.nproc_per_node, 4);
  auto cpu = parse({"--nproc_per_node", "cpu"});
  tools::resolve_nproc_per_node(cpu, 4, 16, fail);
  EXPECT_EQ(cpu.nproc_per_node, 16);
  auto automatic = parse({"--nproc-per-node", "auto"});
  tools::resolve_nproc_per_node(automatic, 0, 16, fail);
  EXPECT_EQ(automatic.nproc_per_node, 16) << "no GPU: one rank per core, as torchrun";
  auto none = parse({"--nproc-per-node", "gpu"});
  EXPECT_THROW(tools::resolve_nproc_per_node(none, 0, 16, fail), tools::RunUsageError);
  EXPECT_EQ(refusal({"--nproc-per-node", "many"}),
            "--nproc-per-node many: expected a number of ranks from 1 to 1024, or auto, cpu or gpu.");
  EXPECT_EQ(refusal({"--local-ranks-filter", "0,x"}), "--local-ranks-filter 0,x: 'x' is not a local rank; expected "
                                                       "local ranks from 0 separated by commas, for example 0 or 0,1.");
  EXPECT_EQ(refusal({"--standalone", "--nnodes", "2", "--master-addr", "h"}),
            "--standalone is a job of one node on its own; drop --nnodes, --rdzv-endpoint, --rdzv-backend and "
            "--master-addr, or drop --standalone.");
}

// --local-ranks-filter 5 with 2 ranks hid every rank's output, silently.
TEST(RunOptions, ALocalRanksFilterOfNoRankHereIsRefused) {
  const auto fail = [](const std::string& message) { throw tools::RunUsageError(message, 2); };
  auto none = parse({"--nproc-per-node", "2", "--local-ranks-filter", "5"});
  try {
    tools::check_local_ranks_filter(none, fail);
    ADD_FAILURE() << "accepted";
  } catch (const tools::RunUsageError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("--local-ranks-filter 5 names no rank of this node (this node runs 2 "
                                          "rank(s), local ranks 0 to 1), so no rank's output", 0), 0u) << e.what();
  }
  auto some = parse({"--nproc-per-node", "2", "--local-ranks-filter", "1,5,7"});
  tools::check_local_ranks_filter(some, fail);
  ASSERT_EQ(some.notes.size(), 1u);
  EXPECT_EQ(some.notes[0], "--local-ranks-filter 1,5,7: this node runs 2 rank(s), local ranks 0 to 1; 5,7 are not "
                           "among them.");
  auto all = parse({"--nproc-per-node", "2", "--local-ranks-filter", "0,1"});
  tools::check_local_ranks_filter(all, fail);
  EXPECT_TRUE(all.notes.empty());
}

} // namespace
} // namespace lockstep
