// Several hosts, for real: each host is a network namespace with its own address (bench's
// FakeHosts), each runs its own `paratrain launch`, and the ranks meet over the namespaces' bridge
// as they would over a LAN. The DDP workers check themselves against single-process training.
// Needs root (network namespaces); without it each test skips and says so.

#include "fake_hosts.h"
#include "paratrain/launch/launch.h"  // find_program
#include "test_util.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

namespace paratrain {
namespace testing {
namespace {

using cli::FakeHosts;

#define SKIP_WITHOUT_NAMESPACES()                            \
  do {                                                       \
    const std::string why = FakeHosts::unavailable_reason(); \
    if (!why.empty()) {                                      \
      GTEST_SKIP() << why;                                   \
    }                                                        \
  } while (0)

// Runs `per_host(k)` on every host at once; returns each host's result (host 0 first).
std::vector<ProcessResult> run_on_hosts(const FakeHosts& hosts,
                                        const std::function<std::vector<std::string>(int)>& argv,
                                        const std::map<std::string, std::string>& env,
                                        double timeout_seconds = 180) {
  std::vector<RunningProcess> running;
  for (int k = 1; k < hosts.size(); ++k) {
    running.push_back(start_process(hosts.exec(k, argv(k)), env));
  }
  std::vector<ProcessResult> out{run_process(hosts.exec(0, argv(0)), env, timeout_seconds)};
  for (auto& p : running) {
    out.push_back(p.finish(timeout_seconds));
  }
  return out;
}

void expect_ranks_ok(const std::vector<ProcessResult>& results, int world) {
  std::string all;
  for (const auto& r : results) {
    all += r.output;
    EXPECT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  for (int rank = 0; rank < world; ++rank) {
    const std::string line = "rank " + std::to_string(rank) + ": ok";
    EXPECT_NE(all.find(line), std::string::npos) << "missing '" << line << "' in\n" << all;
  }
}

// `paratrain launch` of host k of a static two-node job (2 ranks each, node 0 serving at 29500).
std::vector<std::string> static_launch(const FakeHosts& hosts,
                                       int k,
                                       const std::vector<std::string>& extra,
                                       const std::vector<std::string>& worker) {
  std::vector<std::string> argv{cli_path(),         "launch",
                                "--nnodes",         "2",
                                "--nproc-per-node", "2",
                                "--node-rank",      std::to_string(k),
                                "--master-addr",    hosts.address(0),
                                "--master-port",    "29500"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back("--");
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

void expect_ddp_across_hosts(const std::string& backend) {
  FakeHosts hosts(2);
  auto results = run_on_hosts(
      hosts,
      [&](int k) {
        return static_launch(hosts, k, {"--backend", backend}, {PARATRAIN_TEST_DDP_WORKER});
      },
      {{"PARATRAIN_TIMEOUT", "60"}});
  expect_ranks_ok(results, 4);
}

TEST(MultiHost, DdpOnGlooAcrossTwoHostsEqualsOneProcess) {
  SKIP_WITHOUT_NAMESPACES();
  expect_ddp_across_hosts("gloo");
}

// Inside a Slurm allocation of two nodes, srun starts one launcher per node with the allocation's
// variables (here given as srun would: the node list names the hosts' addresses, as Slurm's
// NodeName list can). Neither launcher is told --nnodes, --node-rank or --master-addr.
TEST(MultiHost, SlurmAllocationPlacesEachNode) {
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(2);
  auto results = run_on_hosts(hosts,
                              [&](int k) {
                                return std::vector<std::string>{"/usr/bin/env",
                                                                "SLURM_NODEID=" + std::to_string(k),
                                                                cli_path(),
                                                                "launch",
                                                                "--nproc-per-node",
                                                                "2",
                                                                "--",
                                                                PARATRAIN_TEST_DDP_WORKER};
                              },
                              {{"PARATRAIN_TIMEOUT", "60"},
                               {"SLURM_JOB_ID", "77"},
                               {"SLURM_JOB_NODELIST", "10.77.0.[1-2]"},
                               {"SLURM_STEP_NODELIST", "10.77.0.[1-2]"},
                               {"SLURM_NNODES", "2"},
                               {"SLURM_STEP_NUM_NODES", "2"},
                               {"SLURM_STEP_NUM_TASKS", "2"}});
  expect_ranks_ok(results, 4);
  for (int k = 0; k < 2; ++k) {
    EXPECT_NE(results[static_cast<size_t>(k)].output.find(
                  "Slurm job 77: node " + std::to_string(k) + " of 2 (" + hosts.address(k) +
                  "), node 0 " + hosts.address(0)),
              std::string::npos)
        << results[static_cast<size_t>(k)].output;
  }
}

// Static rendezvous with --max-restarts on two hosts: host 1's worker fails in the first attempt
// while host 0's would run for minutes. Host 0 stops its worker at once, and both start attempt 1
// together with one TORCHELASTIC_RESTART_COUNT, in which DDP across the hosts matches one process.
TEST(MultiHost, StaticRestartsAreAgreedAcrossNodes) {
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(2);
  const std::string script =
      "echo \"attempt $TORCHELASTIC_RESTART_COUNT of node $GROUP_RANK\"; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
      "  if [ \"$GROUP_RANK\" = 1 ]; then sleep 2; exit 3; fi; sleep 300; fi; "
      "exec \"$0\"";
  const auto start = std::chrono::steady_clock::now();
  auto results =
      run_on_hosts(hosts,
                   [&](int k) {
                     return static_launch(hosts, k, {"--max-restarts", "2"},
                                          {"/bin/sh", "-c", script, PARATRAIN_TEST_DDP_WORKER});
                   },
                   {{"PARATRAIN_TIMEOUT", "60"}});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  expect_ranks_ok(results, 4);
  EXPECT_LT(seconds, 120) << "host 0 waited for its worker instead of restarting with host 1";
  for (int k = 0; k < 2; ++k) {
    const std::string& out = results[static_cast<size_t>(k)].output;
    EXPECT_NE(out.find("attempt 1 of node " + std::to_string(k)), std::string::npos) << out;
    EXPECT_EQ(out.find("attempt 2 of node"), std::string::npos) << out;
    EXPECT_NE(out.find("round 1: node " + std::to_string(k) + " of 2, world size 4"),
              std::string::npos)
        << out;
  }
  EXPECT_NE(results[1].output.find("exited with code 3"), std::string::npos) << results[1].output;
  EXPECT_NE(results[0].output.find("another node opened rendezvous round 1 after a failure"),
            std::string::npos)
      << results[0].output;
}

// A node of a static job with --max-restarts dies (its launcher SIGKILLed): the job cannot go on
// without it, so the other node ends at once with the reason instead of waiting for it. Node 1
// dies (node 0 sees its heartbeat stop), then node 0, whose launcher served the nodes' store.
TEST(Rendezvous, StaticJobEndsWhenANodeDies) {
  for (const int victim : {1, 0}) {
    SCOPED_TRACE("node " + std::to_string(victim) + " dies");
    const std::string port = std::to_string(free_port());
    auto node = [&](int k) {
      return start_process({cli_path(), "launch", "--nnodes", "2", "--node-rank", std::to_string(k),
                            "--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts",
                            "3", "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2",
                            "--", "/bin/sh", "-c", "echo started; sleep 300"});
    };
    std::vector<RunningProcess> nodes{node(0), node(1)};
    for (auto& p : nodes) {
      ASSERT_TRUE(p.wait_for_output("started", 60)) << p.output;
    }
    const auto start = std::chrono::steady_clock::now();
    auto& dead = nodes[static_cast<size_t>(victim)];
    ::kill(-dead.pid, SIGKILL);
    ::kill(dead.pid, SIGKILL);
    dead.finish(10);
    auto r = nodes[static_cast<size_t>(1 - victim)].finish(60);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_LT(seconds, 15) << r.output;
    // Node 1's launcher ended (its connection closed): gone after the 2 s keep-alive and the 2 s
    // a closed connection is given to come back.
    const std::regex gone(victim == 1 ? "node 1 \\(127\\.0\\.0\\.1\\) stopped its heartbeat "
                                        "[4-9](\\.[0-9]+)? s ago; a static job cannot go on "
                                        "without it"
                                      : "node 0's launcher \\(127\\.0\\.0\\.1:" +
                                            std::to_string(std::stoi(port) + 1) + "\\) is gone");
    EXPECT_TRUE(std::regex_search(r.output, gone)) << r.output;
    EXPECT_EQ(r.output.find("to join the next round"), std::string::npos) << r.output;
  }
}

// `paratrain train` of the mlp on Fashion-MNIST (DDP over gloo, one epoch, a checkpoint every 20
// steps, --resume auto), its final weights written to `weights`.
std::vector<std::string> train_mlp(const std::string& dir, const std::string& weights) {
  return {cli_path(),
          "train",
          "--model",
          "mlp",
          "--strategy",
          "ddp",
          "--backend",
          "gloo",
          "--device",
          "cpu",
          "--epochs",
          "1",
          "--seed",
          "0",
          "--batch-size",
          "64",
          "--lr",
          "0.05",
          "--momentum",
          "0.9",
          "--resume",
          "auto",
          "--checkpoint-every",
          "20",
          "--checkpoint-dir",
          dir + "/ckpt",
          "--save-weights",
          weights};
}

// A static two-node job (one rank per host, --max-restarts 3, the rendezvous' `conf`) trains the
// mlp while host 1's link is down for `cut_seconds`, from its first checkpoint on. Returns both
// nodes' results; the weights are in dir/partitioned.safetensors.
std::vector<ProcessResult> train_through_partition(FakeHosts& hosts,
                                                   const std::string& dir,
                                                   const std::string& conf,
                                                   double cut_seconds) {
  std::vector<RunningProcess> running;
  for (int k = 0; k < 2; ++k) {
    std::vector<std::string> argv{cli_path(),
                                  "launch",
                                  "--nnodes",
                                  "2",
                                  "--nproc-per-node",
                                  "1",
                                  "--node-rank",
                                  std::to_string(k),
                                  "--master-addr",
                                  hosts.address(0),
                                  "--master-port",
                                  "29500",
                                  "--max-restarts",
                                  "3",
                                  "--rdzv-conf",
                                  conf,
                                  "--"};
    const auto job = train_mlp(dir, dir + "/partitioned.safetensors");
    argv.insert(argv.end(), job.begin(), job.end());
    running.push_back(start_process(hosts.exec(k, argv), {{"PARATRAIN_TIMEOUT", "120"}}));
  }
  const std::string first = dir + "/ckpt/ckpt-0000000020.json";
  for (int i = 0; i < 1200 && ::access(first.c_str(), F_OK) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(::access(first.c_str(), F_OK), 0) << running[0].output;
  hosts.set_link(1, false);
  std::this_thread::sleep_for(std::chrono::duration<double>(cut_seconds));
  hosts.set_link(1, true);
  std::vector<ProcessResult> out;
  for (auto& p : running) {
    out.push_back(p.finish(240));
  }
  return out;
}

// The same training on one host without a partition: the weights both partition cases must
// match bit for bit.
std::string unpartitioned_weights(const std::string& dir) {
  auto job = train_mlp(dir + "/reference", dir + "/reference.safetensors");
  job.insert(job.begin() + 2, {"--nproc", "2"});
  const auto r = run_process(job, {{"PARATRAIN_TIMEOUT", "120"}}, 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return file_bytes(dir + "/reference.safetensors");
}

// Note [Partitions and dead nodes], shorter: host 1 is cut off for 6 s while a node is taken for
// gone after 15 s without its heartbeat (5 s x 3, torchrun's default). The job rides it out: no
// restart, and the weights are bitwise those of the same job on one host.
TEST(MultiHost, PartitionShorterThanKeepAliveIsRiddenOut) {  // ctest: slow 45
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(2);
  const std::string dir = make_temp_dir("paratrain-partition");
  const auto nodes =
      train_through_partition(hosts, dir, "keep_alive_interval=5,keep_alive_max_attempt=3", 6);
  for (const auto& r : nodes) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("round 1"), std::string::npos) << "restarted:\n" << r.output;
  }
  const std::string weights = file_bytes(dir + "/partitioned.safetensors");
  EXPECT_FALSE(weights.empty());
  EXPECT_TRUE(weights == unpartitioned_weights(dir)) << "the weights differ from one host's";
  remove_tree(dir);
}

// Note [Partitions and dead nodes], longer: cut off for 12 s while a node is taken for gone after
// 4 s. Both nodes stop their workers (node 0 sees host 1 unreachable, host 1 its store); once the
// link is back, host 1 joins round 1 and both resume from the newest checkpoint, bitwise.
TEST(MultiHost, PartitionLongerThanKeepAliveRestartsTogetherAndResumesBitwise) {  // ctest: slow 50
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(2);
  const std::string dir = make_temp_dir("paratrain-partition");
  const auto nodes =
      train_through_partition(hosts, dir, "keep_alive_interval=1,keep_alive_max_attempt=4", 12);
  for (int k = 0; k < 2; ++k) {
    const std::string& out = nodes[static_cast<size_t>(k)].output;
    EXPECT_EQ(nodes[static_cast<size_t>(k)].exit_code, 0) << out;
    EXPECT_NE(out.find("round 1: node " + std::to_string(k) + " of 2"), std::string::npos) << out;
    EXPECT_EQ(out.find("round 2"), std::string::npos) << out;
  }
  EXPECT_NE(nodes[0].output.find("node 1 (" + hosts.address(1) +
                                 ") has not been heard from for 4 s, and its connection is "
                                 "still open"),
            std::string::npos)
      << nodes[0].output;
  EXPECT_NE(nodes[1].output.find("has not answered for"), std::string::npos) << nodes[1].output;
  EXPECT_NE(nodes[0].output.find("resumed from "), std::string::npos) << nodes[0].output;
  const std::string weights = file_bytes(dir + "/partitioned.safetensors");
  EXPECT_FALSE(weights.empty());
  EXPECT_TRUE(weights == unpartitioned_weights(dir)) << "the weights differ from one host's";
  remove_tree(dir);
}

#ifdef PARATRAIN_WITH_MPI
// Open MPI's own remote start: mpirun on host 0 starts its daemon on host 1 through the rsh agent,
// here a script that enters host 1's namespace (where ssh would log in).
TEST(MultiHost, DdpOnMpiAcrossTwoHostsThroughAHostfile) {
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(2);
  auto env = hosts.mpirun_env();
  env["PARATRAIN_TIMEOUT"] = "60";
  auto r = run_process(hosts.exec(0, {cli_path(), "launch", "--backend", "mpi", "--hostfile",
                                      hosts.write_hostfile(2), "--nproc-per-node", "2", "--",
                                      PARATRAIN_TEST_DDP_WORKER}),
                       env, 180);
  expect_ranks_ok({r}, 4);
}
#endif

// Where a job serves, seen from inside it: host 0's ranks try its loopback and its 10.77.0.1, at
// MASTER_PORT and at 29400; host 0's output (each host has its own loopback).
std::string probe_store(const std::vector<std::string>& launch_args, int hosts_n) {
  FakeHosts hosts(hosts_n);
  auto results = run_on_hosts(
      hosts,
      [&](int k) {
        std::vector<std::string> argv{cli_path(), "launch"};
        for (const auto& a : launch_args) {
          argv.push_back(a == "NODE" ? std::to_string(k) : a);
        }
        argv.insert(argv.end(), {"--", PARATRAIN_TEST_STORE_PROBE, "127.0.0.1", hosts.address(0),
                                 "127.0.0.1:29400", hosts.address(0) + ":29400"});
        return argv;
      },
      {{"PARATRAIN_TIMEOUT", "60"}});
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  return results[0].output;
}

TEST(Addresses, OneNodeJobServesItsStoreOnLoopbackOnly) {
  SKIP_WITHOUT_NAMESPACES();
  const std::string out = probe_store({"--nproc-per-node", "2", "--master-port", "29500"}, 1);
  EXPECT_NE(out.find("127.0.0.1:29500 accepts"), std::string::npos) << out;
  EXPECT_NE(out.find("10.77.0.1:29500 refuses"), std::string::npos) << out;
}

TEST(Addresses, SeveralNodesServeTheStoreOnlyAtMasterAddr) {
  SKIP_WITHOUT_NAMESPACES();
  const std::string out =
      probe_store({"--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "NODE", "--master-addr",
                   "10.77.0.1", "--master-port", "29500"},
                  2);
  EXPECT_NE(out.find("10.77.0.1:29500 accepts"), std::string::npos) << out;
  EXPECT_NE(out.find("127.0.0.1:29500 refuses"), std::string::npos) << out;
}

TEST(Addresses, TheRendezvousListensOnlyAtItsEndpoint) {
  SKIP_WITHOUT_NAMESPACES();
  const std::string out = probe_store({"--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                                       "10.77.0.1:29400", "--rdzv-id", "addr"},
                                      2);
  EXPECT_NE(out.find("10.77.0.1:29400 accepts"), std::string::npos) << out;
  EXPECT_NE(out.find("127.0.0.1:29400 refuses"), std::string::npos) << out;
}

// `paratrain launch` for the dynamic rendezvous on host 0's port 29400.
std::vector<std::string> rdzv_launch(const FakeHosts& hosts,
                                     const std::string& id,
                                     const std::string& nnodes,
                                     const std::vector<std::string>& extra,
                                     const std::vector<std::string>& worker) {
  std::vector<std::string> argv{cli_path(),         "launch", "--nnodes",  nnodes,
                                "--nproc-per-node", "1",      "--rdzv-id", id};
  // Host 0's port 29400, unless `extra` names the endpoint (an etcd's).
  if (std::find(extra.begin(), extra.end(), "--rdzv-endpoint") == extra.end()) {
    argv.insert(argv.end(), {"--rdzv-endpoint", hosts.address(0) + ":29400"});
  }
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back("--");
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// Heartbeats every second, a node dead after two missed, and a round closed 2 s after MIN nodes.
const std::vector<std::string> kFastElastic{
    "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"};

// Starts the launchers of elastic job `id` (--nnodes 2:3) on hosts [from, to).
void start_elastic(std::vector<RunningProcess>& running,
                   const FakeHosts& hosts,
                   const std::string& id,
                   int from,
                   int to,
                   const std::vector<std::string>& conf,
                   const std::vector<std::string>& worker) {
  for (int k = from; k < to; ++k) {
    running.push_back(start_process(hosts.exec(k, rdzv_launch(hosts, id, "2:3", conf, worker)),
                                    {{"PARATRAIN_TIMEOUT", "60"}}));
  }
}

// Two jobs share one endpoint (host 0 runs a node of each): node ranks come from the order of
// joining, and the jobs' ids keep them apart.
TEST(MultiHost, DynamicRendezvousKeepsJobsApart) {
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(3);
  const std::vector<std::string> worker{PARATRAIN_TEST_DDP_WORKER};
  const std::vector<std::string> fast{"--rdzv-conf", "last_call_timeout=1"};
  const std::map<std::string, std::string> env{{"PARATRAIN_TIMEOUT", "60"}};
  std::vector<std::pair<int, std::string>> nodes{{0, "a"}, {1, "a"}, {0, "b"}, {2, "b"}};
  std::vector<RunningProcess> running;
  for (const auto& [host, id] : nodes) {
    running.push_back(
        start_process(hosts.exec(host, rdzv_launch(hosts, id, "2", fast, worker)), env));
  }
  std::map<std::string, std::string> by_job;
  std::set<std::string> node_ranks;
  for (size_t i = 0; i < running.size(); ++i) {
    auto r = running[i].finish(120);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    by_job[nodes[i].second] += r.output;
    for (const char* place : {"node 0 of 2", "node 1 of 2"}) {
      if (r.output.find(place) != std::string::npos) {
        node_ranks.insert(nodes[i].second + place);
      }
    }
  }
  EXPECT_EQ(node_ranks.size(), 4u) << "each job has a node 0 and a node 1";
  for (const auto& [id, output] : by_job) {
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NE(output.find("rank " + std::to_string(rank) + ": ok"), std::string::npos)
          << id << "\n"
          << output;
    }
    EXPECT_NE(output.find("rendezvous " + id + " round 0"), std::string::npos) << output;
  }
}

// --nnodes 2:3 with three hosts; host 2 dies (SIGKILL of its launcher, whose workers follow): the
// others see its heartbeat stop, form round 1 without it, and finish with world size 2.
TEST(MultiHost, ElasticJobContinuesWithoutADeadHost) {  // ctest: slow 14
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(3);
  const std::vector<std::string> worker{PARATRAIN_TEST_DDP_WORKER, "--steps", "1000",
                                        "--step-sleep-ms", "10"};
  std::vector<RunningProcess> running;
  start_elastic(running, hosts, "el", 0, 3, kFastElastic, worker);
  for (auto& p : running) {
    ASSERT_TRUE(p.wait_for_output("world size 3", 60)) << p.output;
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  ::kill(-running[2].pid, SIGKILL);
  ::kill(running[2].pid, SIGKILL);
  running[2].finish(30);
  std::string both;
  for (int k = 0; k < 2; ++k) {
    auto r = running[static_cast<size_t>(k)].finish(120);
    both += r.output;
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("round 1: node"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("of 2, world size 2"), std::string::npos) << r.output;
    // Either its monitor saw the change first, or its workers failed and it then saw it.
    EXPECT_TRUE(r.output.find("a change of membership, not a restart") != std::string::npos ||
                r.output.find("stopped this node's workers to join the next round") !=
                    std::string::npos)
        << r.output;
  }
  // One of them saw the heartbeat stop (the other may learn it from the round it opened).
  EXPECT_NE(both.find("(10.77.0.3) stopped its heartbeat"), std::string::npos) << both;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(both.find("rank " + std::to_string(rank) + ": ok, max diff"), std::string::npos)
        << both;
  }
}

// Across the attempts' logs in `dir` (rank-R.attempt-A: "epoch step samples..." per line), every
// sample of the epoch was trained once, by the attempt that last trained its step.
void expect_every_sample_once(const std::string& dir, int samples) {
  // step -> (attempt, samples trained at that step by every rank of that attempt)
  std::map<int64_t, std::pair<int, std::vector<int64_t>>> trained;
  int attempts_seen = 0;
  for (int rank = 0; rank < 3; ++rank) {
    for (int attempt = 0; attempt < 4; ++attempt) {
      std::ifstream in(dir + "/rank-" + std::to_string(rank) + ".attempt-" +
                       std::to_string(attempt));
      for (std::string line; std::getline(in, line);) {
        std::istringstream words(line);
        int64_t epoch = 0, step = 0;
        words >> epoch >> step;
        ASSERT_EQ(epoch, 0) << line;
        auto& slot = trained[step];
        if (attempt > slot.first || slot.second.empty()) {
          slot = {attempt, {}};
        }
        if (attempt == slot.first) {
          for (int64_t i; words >> i;) {
            slot.second.push_back(i);
          }
        }
        attempts_seen = std::max(attempts_seen, attempt + 1);
      }
    }
  }
  EXPECT_GE(attempts_seen, 2) << "no step was trained after the membership change";
  std::vector<int> count(samples, 0);
  int64_t total = 0;
  for (const auto& [step, slot] : trained) {
    for (int64_t i : slot.second) {
      ASSERT_TRUE(i >= 0 && i < samples) << i;
      ++count[static_cast<size_t>(i)];
      ++total;
    }
  }
  for (int i = 0; i < samples; ++i) {
    EXPECT_GE(count[static_cast<size_t>(i)], 1) << "sample " << i << " was never trained";
  }
  EXPECT_LE(total - samples, 1) << "samples trained twice beyond the sampler's padding";
}

// The Trainer across a membership change: three hosts train one epoch with checkpoints, host
// `victim` dies mid-epoch (SIGKILL of its launcher, whose workers follow), and the other two resume
// the newest checkpoint (made by three ranks) with two. The rest of the epoch is shared out anew,
// so across the trained steps (for each step, the attempt that last trained it) every sample of
// the epoch is trained once; only the sampler's padding to an even split (at most world - 1
// samples) may repeat one. `conf`: the rendezvous' flags.
void expect_no_sample_lost(const FakeHosts& hosts,
                           const std::string& id,
                           const std::vector<std::string>& conf,
                           int victim) {
  const std::string dir = "/tmp/" + unique_token("paratrain-elastic");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string ckpt = dir + "/ckpt";
  const int samples = 960;
  const std::vector<std::string> worker{PARATRAIN_TEST_ELASTIC_WORKER, dir, ckpt,
                                        std::to_string(samples), "100"};
  std::vector<RunningProcess> running;
  // Host 0 first: it joins the rendezvous before the others.
  start_elastic(running, hosts, id, 0, 1, conf, worker);
  ASSERT_TRUE(running[0].wait_for_output("joining", 30)) << running[0].output;
  start_elastic(running, hosts, id, 1, 3, conf, worker);
  for (auto& p : running) {
    ASSERT_TRUE(p.wait_for_output("world size 3", 60)) << p.output;
  }
  // Kill once a checkpoint of the three is on disk, mid-epoch.
  auto listing = [&] {
    return run_process(
               {"/bin/sh", "-c", "ls '" + ckpt + "' 2>/dev/null | grep -c '^ckpt-[0-9]*.json$'"},
               {}, 10)
        .output;
  };
  for (int i = 0; i < 600 && std::atoi(listing().c_str()) < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(std::atoi(listing().c_str()), 2) << running[0].output;
  const auto v = static_cast<size_t>(victim);
  ::kill(-running[v].pid, SIGKILL);
  ::kill(running[v].pid, SIGKILL);
  running[v].finish(30);
  std::string survivors;
  for (size_t k = 0; k < 3; ++k) {
    if (k == v) {
      continue;
    }
    auto r = running[k].finish(180);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("of 2, world size 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("ok world 2"), std::string::npos) << r.output;
    survivors += r.output;
  }
  // Rank 0 of the new world says where it resumed.
  EXPECT_NE(survivors.find("resumed from "), std::string::npos) << survivors;
  expect_every_sample_once(dir, samples);
  remove_tree(dir);
}

TEST(MultiHost, ElasticTrainingLosesNoSampleAcrossAMembershipChange) {  // ctest: slow 15
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(3);
  expect_no_sample_lost(hosts, "train", kFastElastic, 2);
}

// A host that comes while the job runs (--nnodes 2:3) waits as a standby; the running nodes form a
// new round that takes it in, and all three finish together.
TEST(MultiHost, ElasticJobTakesInALateHost) {  // ctest: slow 20
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(3);
  const std::vector<std::string> worker{PARATRAIN_TEST_DDP_WORKER, "--steps", "1000",
                                        "--step-sleep-ms", "10"};
  const std::vector<std::string> conf{"--rdzv-conf", "last_call_timeout=1"};
  std::vector<RunningProcess> running;
  start_elastic(running, hosts, "late", 0, 2, conf, worker);
  for (auto& p : running) {
    ASSERT_TRUE(p.wait_for_output("world size 2", 60)) << p.output;
  }
  start_elastic(running, hosts, "late", 2, 3, conf, worker);
  for (auto& p : running) {
    auto r = p.finish(120);
    EXPECT_EQ(r.exit_code, 0) << r.output;

    EXPECT_NE(r.output.find("of 3, world size 3"), std::string::npos) << r.output;
  }
  std::string all;
  for (auto& p : running) {
    all += p.output;
  }
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(all.find("rank " + std::to_string(rank) + ": ok"), std::string::npos) << all;
  }
}

// Inside a host, only its own subnet has a route.
TEST(MultiHost, UnreachableHostfileEntryIsNamed) {
  SKIP_WITHOUT_NAMESPACES();
  FakeHosts hosts(1);
  const std::string file = "/tmp/" + unique_token("paratrain-unreachable") + ".hosts";
  std::ofstream(file) << hosts.address(0) << "\n10.78.0.9 slots=2\n";
  auto r = run_process(hosts.exec(0, {cli_path(), "launch", "--backend", "mpi", "--hostfile", file,
                                      "--", "/bin/true"}),
                       {}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--hostfile " + file +
                          " line 2: host '10.78.0.9' is unreachable from this host (Network is "
                          "unreachable)"),
            std::string::npos)
      << r.output;
  std::remove(file.c_str());
}

// The rendezvous' bad input, on loopback.
TEST(Rendezvous, BadInput) {
  const std::string port = std::to_string(free_port());
  const std::string ep = "127.0.0.1:" + port;
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases{
      {{"--nnodes", "3:2"}, "--nnodes 3:2: MIN must be at least 1 and at most MAX"},
      {{"--nnodes", "1:3"}, "--nnodes 1:3 is elastic: it needs a dynamic rendezvous"},
      {{"--nnodes", "2", "--rdzv-endpoint", ep, "--rdzv-conf", "join_timout=3"},
       "--rdzv-conf: unknown key 'join_timout'"},
      {{"--nnodes", "2", "--rdzv-endpoint", "nohostport"},
       "--rdzv-endpoint 'nohostport' is not host:port"},
      {{"--nnodes", "2", "--rdzv-endpoint", ep, "--rdzv-id", "lonely", "--rdzv-conf",
        "join_timeout=2"},
       "rendezvous 'lonely' at " + ep + ": 1 of the 2 nodes needed (--nnodes 2:2) joined within 2"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "launch"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    // The last case joins a rendezvous (a store and its threads): in a process of its own. The
    // others are refused before anything starts: in this one.
    const bool joins = &c == &cases.back();
    auto r = joins ? run_process(argv, {}, 60) : run_cli(argv);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.message << "\n" << r.output;
  }
}

// Static rendezvous (--node-rank): node 1 never comes; node 0's ranks name it after the timeout.
TEST(Rendezvous, StaticNodeThatNeverJoinsIsNamed) {
  const std::string port = std::to_string(free_port());
  auto r = run_process(
      {cli_path(), "launch", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0",
       "--master-addr", "127.0.0.1", "--master-port", port, "--", PARATRAIN_TEST_DDP_WORKER},
      {{"PARATRAIN_TIMEOUT", "3"}}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("did not: ranks 2, 3 (node rank 1, 2 ranks per node, never joined)"),
            std::string::npos)
      << r.output;
}

// Two launchers claim node rank 1: the second copy of each rank says so.
TEST(Rendezvous, TwoNodesClaimingOneNodeRankAreNamed) {  // ctest: slow 11
  const std::string port = std::to_string(free_port());
  auto node = [&](int k) {
    return std::vector<std::string>{cli_path(),
                                    "launch",
                                    "--nnodes",
                                    "3",
                                    "--nproc-per-node",
                                    "1",
                                    "--node-rank",
                                    std::to_string(k),
                                    "--master-addr",
                                    "127.0.0.1",
                                    "--master-port",
                                    port,
                                    "--",
                                    PARATRAIN_TEST_DDP_WORKER};
  };
  const std::map<std::string, std::string> env{{"PARATRAIN_TIMEOUT", "5"}};
  auto zero = start_process(node(0), env);
  auto one = start_process(node(1), env);
  auto again = start_process(node(1), env);
  std::string all = zero.finish(60).output + one.finish(60).output + again.finish(60).output;
  EXPECT_NE(all.find("rank 1 joined twice (from 127.0.0.1 and from 127.0.0.1): two processes "
                     "were started with the same rank; two nodes claim node rank 1: give each "
                     "node its own --node-rank"),
            std::string::npos)
      << all;
}

// A node out of restarts ends the job for every node at once, with its reason, instead of leaving
// the others to wait for a round that cannot form.
TEST(Rendezvous, ANodeThatGivesUpEndsTheJob) {
  // Node 1 quits, then node 0 (the first to join, which serves the rendezvous) quits.
  for (const std::string quitter : {"1", "0"}) {
    SCOPED_TRACE("node " + quitter + " quits");
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
    auto node = [&] {
      return start_process(
          {cli_path(), "launch", "--nnodes", "2", "--rdzv-endpoint", ep, "--rdzv-id", "quits",
           "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
           "--", "/bin/sh", "-c", "test \"$GROUP_RANK\" != " + quitter + " || exit 3; sleep 60"});
    };
    auto a = node();
    ASSERT_TRUE(a.wait_for_output("joining", 30)) << a.output;  // a serves and is node 0
    auto b = node();
    const auto start = std::chrono::steady_clock::now();
    auto ra = a.finish(120);
    auto rb = b.finish(120);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(ra.exit_code, 0) << ra.output;
    EXPECT_NE(rb.exit_code, 0) << rb.output;
    EXPECT_LT(seconds, 40) << ra.output << rb.output;
    const std::string both = ra.output + rb.output;
    EXPECT_NE(both.find("exited with code 3"), std::string::npos) << both;
    EXPECT_NE(both.find("the job ended: paratrain launch: job failed: rank"), std::string::npos)
        << both;
  }
}

// A second job that reuses a running job's id (another command) is refused at once.
// An endpoint named by a host name for loopback (Debian's $(hostname)) is served on loopback only
// now, where other hosts cannot reach it: the serving launcher says so.
TEST(Rendezvous, LoopbackEndpointNameIsWarned) {
  const std::string ep = "localhost:" + std::to_string(free_port());
  auto r = run_process({cli_path(), "launch", "--nnodes", "1:2", "--rdzv-endpoint", ep, "--rdzv-id",
                        "lo", "--rdzv-conf", "last_call_timeout=1", "--", "/bin/true"},
                       {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: --rdzv-endpoint host localhost resolves only to loopback "
                          "addresses here"),
            std::string::npos)
      << r.output;
}

TEST(Rendezvous, IdInUseByAnotherJob) {
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  auto first = start_process({cli_path(), "launch", "--nnodes", "2", "--rdzv-endpoint", ep,
                              "--rdzv-id", "taken", "--", "/bin/true"});
  ASSERT_TRUE(first.wait_for_output("joining", 30)) << first.output;  // it serves and waits
  auto second = run_process({cli_path(), "launch", "--nnodes", "2", "--rdzv-endpoint", ep,
                             "--rdzv-id", "taken", "--", "/bin/echo", "another"},
                            {}, 60);
  EXPECT_NE(second.exit_code, 0);
  EXPECT_NE(second.output.find("rendezvous 'taken' at " + ep + ": the id is in use by another job"),
            std::string::npos)
      << second.output;
  ::kill(-first.pid, SIGKILL);
  first.finish(10);
}

// ---- --rdzv-backend etcd ------------------------------------------------------------------------

// Debian's etcd, started for a test with its data in a temporary directory: on loopback, or in a
// namespace host (`exec_in` wraps its command line). Stopped and removed with the object.
class EtcdServer {
 public:
  static std::string unavailable_reason() {
    return dist::find_program("etcd").empty()
               ? "etcd is missing (Debian's etcd-server; scripts/setup.sh installs it)"
               : "";
  }

  EtcdServer(
      const std::string& address,
      const std::function<std::vector<std::string>(std::vector<std::string>)>& exec_in = nullptr)
      : dir_("/tmp/" + unique_token("paratrain-etcd")), address_(address) {
    port_ = free_port();
    const std::string client = "http://" + address + ":" + std::to_string(port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(free_port());
    std::vector<std::string> argv{dist::find_program("etcd"),
                                  "--data-dir",
                                  dir_,
                                  "--listen-client-urls",
                                  client,
                                  "--advertise-client-urls",
                                  client,
                                  "--listen-peer-urls",
                                  peer,
                                  "--initial-advertise-peer-urls",
                                  peer,
                                  "--initial-cluster",
                                  "default=" + peer};
    server_ = start_process(exec_in ? exec_in(argv) : argv);
    ready_ = server_.wait_for_output("ready to serve client requests", 60);
  }

  ~EtcdServer() {
    ::kill(server_.pid, SIGTERM);
    server_.finish(30);
    remove_tree(dir_);
  }

  bool ready() const { return ready_; }
  const std::string& log() const { return server_.output; }
  std::string endpoint() const { return address_ + ":" + std::to_string(port_); }

 private:
  std::string dir_, address_;
  int port_ = 0;
  RunningProcess server_;
  bool ready_ = false;
};

#define SKIP_WITHOUT_ETCD()                                   \
  do {                                                        \
    const std::string why = EtcdServer::unavailable_reason(); \
    if (!why.empty()) {                                       \
      GTEST_SKIP() << why;                                    \
    }                                                         \
  } while (0)

// Three hosts (--nnodes 2:3) keep their rendezvous in an etcd on a fourth. The launcher of the
// host that joined first is killed: with the c10d backend it served the rendezvous, which would
// die with it; with etcd the other two form a new round and finish the epoch, losing no sample.
TEST(Etcd, ElasticJobSurvivesTheFirstHostsDeath) {  // ctest: slow 15
  SKIP_WITHOUT_NAMESPACES();
  SKIP_WITHOUT_ETCD();
  FakeHosts hosts(4);
  EtcdServer etcd(hosts.address(3),
                  [&](std::vector<std::string> argv) { return hosts.exec(3, argv); });
  ASSERT_TRUE(etcd.ready()) << etcd.log();
  std::vector<std::string> conf{"--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint()};
  conf.insert(conf.end(), kFastElastic.begin(), kFastElastic.end());
  expect_no_sample_lost(hosts, "etcd-train", conf, 0);
}

// Two jobs of two nodes each share one etcd: their ids keep them apart, and each has its node 0
// and node 1.
TEST(Etcd, JobsWithOtherIdsDoNotMix) {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd("127.0.0.1");
  ASSERT_TRUE(etcd.ready()) << etcd.log();
  std::vector<RunningProcess> running;
  const std::vector<std::string> ids{"a", "b", "a", "b"};
  for (const auto& id : ids) {
    running.push_back(
        start_process({cli_path(), "launch", "--nnodes", "2", "--nproc-per-node", "1",
                       "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint(), "--rdzv-id",
                       id, "--rdzv-conf", "last_call_timeout=1", "--", PARATRAIN_TEST_DDP_WORKER},
                      {{"PARATRAIN_TIMEOUT", "60"}}));
  }
  std::map<std::string, std::string> by_job;
  for (size_t i = 0; i < running.size(); ++i) {
    auto r = running[i].finish(120);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    by_job[ids[i]] += r.output;
  }
  for (const auto& [id, output] : by_job) {
    for (const char* place :
         {"round 0: node 0 of 2", "round 0: node 1 of 2", "rank 0: ok", "rank 1: ok"}) {
      EXPECT_NE(output.find(place), std::string::npos) << id << ": " << place << "\n" << output;
    }
    EXPECT_EQ(output.find("world size 4"), std::string::npos) << output;
  }
}

// etcd outlives the launchers: a run whose launchers were all SIGKILLed leaves its round in etcd.
// A new run with the same id sees its heartbeats stand still and starts clean.
TEST(Etcd, ARunWhoseLaunchersWereKilledLeavesTheIdUsable) {  // ctest: slow 14
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd("127.0.0.1");
  ASSERT_TRUE(etcd.ready()) << etcd.log();
  auto node = [&](const std::string& worker) {
    return start_process({cli_path(), "launch", "--nnodes", "2", "--rdzv-backend", "etcd",
                          "--rdzv-endpoint", etcd.endpoint(), "--rdzv-id", "again", "--rdzv-conf",
                          "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
                          "--", "/bin/sh", "-c", worker});
  };
  std::vector<RunningProcess> first{node("echo started; sleep 300"),
                                    node("echo started; sleep 300")};
  for (auto& p : first) {
    ASSERT_TRUE(p.wait_for_output("started", 60)) << p.output;
  }
  for (auto& p : first) {
    ::kill(-p.pid, SIGKILL);
    ::kill(p.pid, SIGKILL);
    p.finish(10);
  }
  auto run_again = [&] {
    std::vector<RunningProcess> again{node("echo done $GROUP_RANK"), node("echo done $GROUP_RANK")};
    std::string both;
    for (auto& p : again) {
      auto r = p.finish(60);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      both += r.output;
    }
    EXPECT_NE(both.find("the last run with this id stands still in round"), std::string::npos)
        << both;
    EXPECT_NE(both.find("done 0"), std::string::npos) << both;
    EXPECT_NE(both.find("done 1"), std::string::npos) << both;
  };
  run_again();
  // Killed before its round closed: a lone first node, waiting for the second to close the round.
  auto lone = node("echo started; sleep 300");
  ASSERT_TRUE(lone.wait_for_output("joining", 60)) << lone.output;
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ::kill(-lone.pid, SIGKILL);
  ::kill(lone.pid, SIGKILL);
  lone.finish(10);
  run_again();
}

// No etcd at the endpoint, or something else there: one line each, and a non-zero exit.
TEST(Etcd, BadEndpointsAreOneLine) {
  const std::string nothing = "127.0.0.1:" + std::to_string(free_port());
  const std::string web = "127.0.0.1:" + std::to_string(free_port());
  const std::string banner = "127.0.0.1:" + std::to_string(free_port());
  const std::string python = dist::find_program("python3");
  ASSERT_FALSE(python.empty());
  auto http = start_process(
      {python, "-u", "-m", "http.server", "--bind", "127.0.0.1", web.substr(web.find(':') + 1)});
  auto ssh_like = start_process(
      {python, "-c",
       "import socket, time\n"
       "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
       "s.bind(('127.0.0.1', " +
           banner.substr(banner.find(':') + 1) +
           ")); s.listen(); print('listening', flush=True)\n"
           "while True:\n"
           "    c, _ = s.accept(); c.sendall(b'SSH-2.0-OpenSSH_9.2\\r\\n'); time.sleep(1); "
           "c.close()\n"});
  ASSERT_TRUE(http.wait_for_output("Serving HTTP", 30)) << http.output;
  ASSERT_TRUE(ssh_like.wait_for_output("listening", 30)) << ssh_like.output;
  const std::vector<std::pair<std::string, std::string>> cases{
      {nothing, "--rdzv-endpoint " + nothing +
                    ": cannot reach etcd within 2 s (Connection refused); start etcd there"},
      {web, "--rdzv-endpoint " + web +
                ": the server there is not etcd (it answered etcd's v3 range request with HTTP "
                "501"},
      {banner, "--rdzv-endpoint " + banner + ": the connection opened, but no HTTP answer came"},
  };
  for (const auto& [endpoint, message] : cases) {
    auto r = run_process(
        {cli_path(), "launch", "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
         endpoint, "--rdzv-conf", "join_timeout=2", "--", "/bin/true"},
        {}, 60);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("paratrain launch: error: " + message), std::string::npos)
        << message << "\n"
        << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  ::kill(http.pid, SIGTERM);
  ::kill(ssh_like.pid, SIGTERM);
  http.finish(10);
  ssh_like.finish(10);
}

TEST(MultiHost, BadHostfiles) {
  const std::string base = "/tmp/" + unique_token("paratrain-badhosts");
  struct Case {
    std::string contents;
    std::vector<std::string> extra;
    std::string message;
  };
  std::vector<Case> cases{
      {"127.0.0.1\nno-such-host.invalid\n",
       {},
       "line 2: host 'no-such-host.invalid' does not resolve"},
      {"127.0.0.1 slots=x\n", {}, "line 1: 'slots=x' is not a slot count"},
      {"# nothing\n", {}, "lists no host"},
      {"127.0.0.1\n127.0.0.1\n", {}, "line 2: host '127.0.0.1' is listed twice"},
      {"127.0.0.1\n", {"--backend", "gloo"}, "--hostfile goes with --backend mpi"},
  };
  for (const auto& c : cases) {
    const std::string file = base + ".hosts";
    std::ofstream(file) << c.contents;
    std::vector<std::string> argv{cli_path(), "launch", "--hostfile", file};
    if (c.extra.empty()) {
      argv.insert(argv.end(), {"--backend", "mpi"});
    }
    argv.insert(argv.end(), c.extra.begin(), c.extra.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    auto r = run_cli(argv);
    EXPECT_NE(r.exit_code, 0) << c.contents;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.message << "\n" << r.output;
  }
  std::remove((base + ".hosts").c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
