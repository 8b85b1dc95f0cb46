// paratrain launch and paratrain::spawn with real processes: the environment each rank sees, the
// device mapping, output relaying, teardown on failure, signals, and no process left behind.

#include "test_util.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

std::map<std::string, std::string> env_line(const std::string& output, int rank) {
  std::string prefix = "[rank " + std::to_string(rank) + "]: ENV ";
  auto pos = output.find(prefix);
  std::map<std::string, std::string> vars;
  if (pos == std::string::npos) {
    return vars;
  }
  std::string line =
      output.substr(pos + prefix.size(), output.find('\n', pos) - pos - prefix.size());
  std::istringstream in(line);
  std::string kv;
  while (in >> kv) {
    auto eq = kv.find('=');
    vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return vars;
}

void expect_no_leftovers(const std::string& token) {
  // The launcher has returned; give the kernel a moment to finish reaping.
  std::vector<int> left;
  for (int i = 0; i < 20; ++i) {
    left = processes_with(token);
    if (left.empty()) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(left.empty()) << left.size() << " process(es) of the job left behind, first pid "
                            << (left.empty() ? 0 : left[0]);
  for (int pid : left) {
    ::kill(pid, SIGKILL);
  }
}

// The one folder a launch made in --log-dir D (D/<rdzv id>_<random>, as torchrun's).
std::string run_folder(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    found.push_back(entry.path().string());
  }
  EXPECT_EQ(found.size(), 1u) << dir;
  return found.empty() ? dir + "/none" : found[0];
}

std::string file_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(Launch, EnvironmentContract) {
  std::string token = unique_token("env");
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "3", "--master-port", "29577",
                        "--", probe_path(), "env", token},
                       {{"OMP_NUM_THREADS", "<unset>"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    auto vars = env_line(r.output, rank);
    ASSERT_FALSE(vars.empty()) << r.output;
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(vars["WORLD_SIZE"], "3");
    EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(vars["GROUP_RANK"], "0");
    EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(vars["MASTER_PORT"], "29577");
    EXPECT_EQ(vars["CUDA_VISIBLE_DEVICES"], "<unset>");
    // torchrun's whole contract: one role, a run id (static jobs too), the restarts.
    EXPECT_EQ(vars["ROLE_NAME"], "default");
    EXPECT_EQ(vars["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(vars["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(vars["TORCHELASTIC_RUN_ID"], "none");
    EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(vars["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(vars["TORCHELASTIC_USE_AGENT_STORE"], "False");
    // cores / local workers, at least 1
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    EXPECT_EQ(vars["OMP_NUM_THREADS"], std::to_string(std::max(1u, cores / 3)));
  }
}

// Two workers under `--local-ranks-filter 1 --redirects 1 --log-dir LOGS` and `extra`: only rank
// 1's stderr reaches the console, and the log files keep every stream.
void expect_rank_1_stderr_on_console(const std::vector<std::string>& extra,
                                     const std::string& logs) {
  std::vector<std::string> argv{cli_path(), "launch", "--nproc-per-node", "2"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--local-ranks-filter", "1", "--redirects", "1", "--log-dir", logs, "--",
                           "/bin/sh", "-c", "echo out $LOCAL_RANK; echo err $LOCAL_RANK >&2"});
  const auto r = run_process(argv, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("[rank 0]"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("out 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: err 1"), std::string::npos) << r.output;
  const std::string run = run_folder(logs);
  EXPECT_EQ(file_text(run + "/attempt_0/0/stdout.log"), "out 0\n");
  EXPECT_EQ(file_text(run + "/attempt_0/1/stdout.log"), "out 1\n");
  EXPECT_EQ(file_text(run + "/attempt_0/1/stderr.log"), "err 1\n");
}

// torchrun's flags that say how many workers, what they are called, and where their output goes.
TEST(Launch, TorchrunFlags) {
  const std::string cores = std::to_string(std::max(1u, std::thread::hardware_concurrency()));
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "cpu", "--role", "trainer", "--",
                        probe_path(), "env", unique_token("cpu")},
                       {{"CUDA_VISIBLE_DEVICES", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto vars = env_line(r.output, 0);
  EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], cores);
  EXPECT_EQ(vars["ROLE_NAME"], "trainer");
  // auto: the GPUs a worker would see, else the CPUs.
  r = run_process({cli_path(), "launch", "--nproc-per-node", "auto", "--", probe_path(), "env",
                   unique_token("auto")},
                  {{"CUDA_VISIBLE_DEVICES", "0,1,2"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(env_line(r.output, 0)["LOCAL_WORLD_SIZE"], "3");
  r = run_process({cli_path(), "launch", "--nproc-per-node", "auto", "--", probe_path(), "env",
                   unique_token("auto")},
                  {{"CUDA_VISIBLE_DEVICES", ""}});
  EXPECT_EQ(env_line(r.output, 0)["LOCAL_WORLD_SIZE"], cores) << r.output;

  // --local-ranks-filter shows one rank; --redirects 1 keeps stdout in the files only.
  const std::string logs = make_temp_dir("redirects");
  expect_rank_1_stderr_on_console({}, logs);
  EXPECT_FALSE(std::filesystem::exists(run_folder(logs) + "/attempt_1"));  // no second attempt
  // As torchrun's, --tee keeps on the console a stream that --redirects sends to the files.
  r = run_process({cli_path(), "launch", "--redirects", "3", "--tee", "1", "--log-dir", logs, "--",
                   "/bin/sh", "-c", "echo out; echo err >&2"},
                  {});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: out"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("err"), std::string::npos) << r.output;
  remove_tree(logs);

  // -m and --run-path run Python's module or script, as torchrun does.
  r = run_process({cli_path(), "launch", "-m", "--", "platform"}, {});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: Linux"), std::string::npos) << r.output;
  const std::string scripts = make_temp_dir("run-path");
  const std::string script = scripts + "/hello.py";
  { std::ofstream(script) << "import os\nprint('hello from', os.environ['RANK'])\n"; }
  r = run_process({cli_path(), "launch", "--run-path", "--no-prefix", "--", script}, {});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hello from 0"), std::string::npos) << r.output;
  remove_tree(scripts);

  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> bad{
      {{"--nproc-per-node", "many"}, "--nproc-per-node must be at least 1, or auto, cpu or gpu"},
      {{"--redirects", "1"}, "--redirects says which streams go to the log files: give --log-dir"},
      {{"--redirects", "4", "--log-dir", "/tmp"}, "--redirects '4' is not N or LOCAL_RANK:N"},
      {{"--tee", "0:x", "--log-dir", "/tmp"}, "--tee '0:x' is not N or LOCAL_RANK:N"},
      {{"--local-ranks-filter", "a"}, "--local-ranks-filter 'a' is not a list of local ranks"},
      {{"--monitor-interval", "0"}, "--monitor-interval must be a positive number of seconds"},
      {{"--no-python", "-m"}, "-m runs PROGRAM with Python, and --no-python says not to"},
      {{"-m", "--run-path"}, "-m and --run-path both say how Python runs PROGRAM"},
      {{"--console-streams", "-1:3"},
       "--console-streams is internal: it is what --backend mpi gives its ranks"},
      {{"--log-dir", "/tmp", "--rdzv-id", "a/b"}, "--rdzv-id 'a/b' names the log folder"},
  };
  for (const auto& c : bad) {
    std::vector<std::string> argv{cli_path(), "launch"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    auto e = run_cli(argv);
    EXPECT_NE(e.exit_code, 0) << c.message;
    EXPECT_NE(e.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << e.output;
  }
  r = run_process({cli_path(), "launch", "--nproc-per-node", "gpu", "--", "/bin/true"},
                  {{"CUDA_VISIBLE_DEVICES", ""}});
  EXPECT_NE(r.output.find("--nproc-per-node gpu: this node has no GPU visible"), std::string::npos)
      << r.output;
}

TEST(Launch, UserOmpNumThreadsWins) {
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "2", "--", probe_path(), "env",
                        unique_token("omp")},
                       {{"OMP_NUM_THREADS", "7"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(env_line(r.output, 1)["OMP_NUM_THREADS"], "7");
}

TEST(Launch, LauncherRunsWithoutLibtorch) {
  // `paratrain launch` runs on the launcher library alone: loading libtorch would cost every
  // launcher about a CPU-second. Its worker reads the launcher's mappings (/proc/PPID/maps).
  auto r = run_process({cli_path(), "launch", "--no-prefix", "--", "/bin/sh", "-c",
                        "grep -o 'lib[a-z0-9_]*\\.so' /proc/$PPID/maps | sort -u"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("libc10.so"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("libtorch"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("libparatrain.so"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("libparatrain_commands.so"), std::string::npos) << r.output;
}

TEST(Launch, MultiNodeRanks) {
  // Node 1 of 2 with 2 workers each: global ranks 2 and 3.
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "2", "--nnodes", "2",
                        "--node-rank", "1", "--master-addr", "127.0.0.1", "--", probe_path(), "env",
                        unique_token("nodes")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto vars = env_line(r.output, 3);
  EXPECT_EQ(vars["RANK"], "3");
  EXPECT_EQ(vars["LOCAL_RANK"], "1");
  EXPECT_EQ(vars["WORLD_SIZE"], "4");
  EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "2");
  EXPECT_EQ(vars["GROUP_RANK"], "1");
  EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "2");
  EXPECT_EQ(vars["ROLE_WORLD_SIZE"], "4");
  EXPECT_FALSE(env_line(r.output, 2).empty());
}

TEST(Launch, DeviceMapping) {
  // Some of the GPUs: 0, 1 and 3 of four. One worker per listed device by default, each sees
  // all three (CUDA_VISIBLE_DEVICES) and uses cuda:LOCAL_RANK, i.e. physical GPU 0, 1, 3.
  auto r = run_process(
      {cli_path(), "launch", "--devices", "0,1,3", "--", probe_path(), "env", unique_token("dev")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    auto vars = env_line(r.output, rank);
    ASSERT_FALSE(vars.empty()) << r.output;
    EXPECT_EQ(vars["CUDA_VISIBLE_DEVICES"], "0,1,3");
    EXPECT_EQ(vars["WORLD_SIZE"], "3");
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
  }
  EXPECT_TRUE(env_line(r.output, 3).empty()) << "a fourth worker was started";
}

TEST(Launch, StandalonePicksAFreePort) {
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                        probe_path(), "env", unique_token("standalone")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto a = env_line(r.output, 0);
  auto b = env_line(r.output, 1);
  EXPECT_EQ(a["MASTER_PORT"], b["MASTER_PORT"]);
  EXPECT_NE(a["MASTER_PORT"], "29500");
  EXPECT_GT(std::stoi(a["MASTER_PORT"]), 0);
}

TEST(Launch, BackendFlagReachesWorkers) {
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "1", "--backend", "gloo", "--",
                        probe_path(), "env", unique_token("backend")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(env_line(r.output, 0)["PARATRAIN_BACKEND"], "gloo");
}

TEST(Launch, LinesArePrefixedAndNeverInterleave) {
  std::string dir = "/tmp/" + unique_token("paratrain-logs");
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "2", "--log-dir", dir, "--",
                        probe_path(), "spam", "400", unique_token("spam")});
  ASSERT_EQ(r.exit_code, 0) << r.output.substr(0, 2000);
  std::regex good(R"(\[rank ([01])\]: line (\d+) ([a-z])\3{299} end)");
  std::istringstream in(r.output);
  std::string line;
  int counts[2] = {0, 0};
  while (std::getline(in, line)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, good)) << "garbled line: " << line.substr(0, 200);
    int rank = std::stoi(m[1]);
    EXPECT_EQ(m[3].str()[0], static_cast<char>('a' + rank))
        << "a line of rank " << rank << " carries another rank's text";
    ++counts[rank];
  }
  EXPECT_EQ(counts[0], 400);
  EXPECT_EQ(counts[1], 400);
  // --log-dir: as torchrun, a folder for the run, one per attempt and one per worker, with its
  // stdout and stderr apart, without prefixes.
  const std::string run = run_folder(dir);
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream log(run + "/attempt_0/" + std::to_string(rank) + "/stdout.log");
    ASSERT_TRUE(log.good()) << "no log file for rank " << rank;
    int n = 0;
    while (std::getline(log, line)) {
      EXPECT_EQ(line.rfind("line ", 0), 0u) << line.substr(0, 80);
      ++n;
    }
    EXPECT_EQ(n, 400);
  }
}

TEST(Launch, FailingWorkerTearsDownTheJob) {
  std::string token = unique_token("exit3");
  std::string dir = "/tmp/" + unique_token("paratrain-logs");
  auto start = std::chrono::steady_clock::now();
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "3", "--log-dir", dir, "--",
                        probe_path(), "exit", "1", "3", token},
                       {}, 60);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 3) << r.output;
  // The summary: first failing rank, its exit code, the time, and its log file.
  std::regex summary(
      R"(paratrain launch: job failed: rank 1 \(local rank 1, pid \d+\) exited with code 3 at )"
      R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[-+]\d{4}; log: )" +
      run_folder(dir) + R"(/attempt_0/1/stderr\.log; stopped the other 2 running workers)");
  EXPECT_TRUE(std::regex_search(r.output, summary)) << r.output;
  EXPECT_LT(seconds, 10.0) << "the others were not stopped within 5 s of the failure";
  expect_no_leftovers(token);
}

TEST(Launch, WorkerKilledBySignal) {
  std::string token = unique_token("sig");
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "2", "--", probe_path(), "signal",
                        "0", std::to_string(SIGSEGV), token},
                       {}, 60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGSEGV) << r.output;
  EXPECT_NE(r.output.find("job failed: rank 0 (local rank 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 11 (Segmentation fault)"), std::string::npos)
      << r.output;
  expect_no_leftovers(token);
}

TEST(Launch, SigintReachesEveryWorker) {
  std::string token = unique_token("sigint");
  RunningProcess p = start_process(
      {cli_path(), "launch", "--nproc-per-node", "2", "--", probe_path(), "wait", token});
  ASSERT_TRUE(p.wait_for_output("[rank 1]: ready", 30)) << p.output;
  ASSERT_TRUE(p.wait_for_output("[rank 0]: ready", 30)) << p.output;
  ASSERT_GE(processes_with(token).size(), 4u) << "2 workers and their children should run";
  ::kill(p.pid, SIGINT);
  ProcessResult r = p.finish(30);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.output;
  EXPECT_NE(r.output.find("interrupted by Interrupt; stopped 2 running workers"), std::string::npos)
      << r.output;
  expect_no_leftovers(token);
}

TEST(Launch, SigtermReachesEveryWorker) {
  std::string token = unique_token("sigterm");
  RunningProcess p = start_process(
      {cli_path(), "launch", "--nproc-per-node", "2", "--", probe_path(), "wait", token});
  ASSERT_TRUE(p.wait_for_output("[rank 1]: ready", 30)) << p.output;
  ASSERT_TRUE(p.wait_for_output("[rank 0]: ready", 30)) << p.output;
  ::kill(p.pid, SIGTERM);
  ProcessResult r = p.finish(30);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  expect_no_leftovers(token);
}

TEST(Launch, SigtermWhileStoppingAfterAFailureEndsTheRestarts) {
  // A worker fails, the launcher stops the others (one ignores SIGTERM: kill_grace), and the user
  // sends SIGTERM meanwhile: the job ends there instead of restarting under --max-restarts.
  std::string token = unique_token("termrestart");
  RunningProcess p = start_process({cli_path(), "launch", "--nproc-per-node", "2", "--max-restarts",
                                    "3", "--", probe_path(), "exit-stubborn", "0", "3", token});
  ASSERT_TRUE(p.wait_for_output("rank 0 exiting with 3", 30)) << p.output;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the launcher is stopping rank 1
  ::kill(p.pid, SIGTERM);
  ProcessResult r = p.finish(30);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("restarting all"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  expect_no_leftovers(token);
}

TEST(Launch, KilledLauncherTakesWorkersAlong) {
  // SIGKILL cannot be forwarded: the workers' parent-death signal ends them instead.
  std::string token = unique_token("sigkill");
  RunningProcess p = start_process(
      {cli_path(), "launch", "--nproc-per-node", "2", "--", probe_path(), "wait", token});
  ASSERT_TRUE(p.wait_for_output("[rank 1]: ready", 30)) << p.output;
  ASSERT_TRUE(p.wait_for_output("[rank 0]: ready", 30)) << p.output;
  ::kill(p.pid, SIGKILL);
  p.finish(10);
  std::vector<int> left;
  for (int i = 0; i < 30 && !(left = processes_with(token)).empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // The workers die with the launcher; their own children are reparented and are the workers'
  // responsibility (a worker killed with SIGKILL cannot clean up), so only the workers count here.
  int workers_left = 0;
  for (int pid : left) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmd.find("wait") != std::string::npos) {
      ++workers_left;
    }
    ::kill(pid, SIGKILL);
  }
  EXPECT_EQ(workers_left, 0);
}

TEST(Launch, MpiBackendRunsThroughMpirun) {
#ifndef PARATRAIN_WITH_MPI
  GTEST_SKIP() << "this build has no mpi backend";
#endif
  std::string token = unique_token("mpi");
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "3", "--backend", "mpi", "--",
                        probe_path(), "env", token},
                       {{"OMP_NUM_THREADS", "<unset>"}}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    auto vars = env_line(r.output, rank);
    ASSERT_FALSE(vars.empty()) << r.output;
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["WORLD_SIZE"], "3");
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(vars["PARATRAIN_BACKEND"], "mpi");
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    EXPECT_EQ(vars["OMP_NUM_THREADS"], std::to_string(std::max(1u, cores / 3)));
  }
}

// torchrun's console flags under mpirun: each rank's shim applies them to its own worker.
TEST(Launch, MpiBackendTakesTheConsoleFlags) {
#ifndef PARATRAIN_WITH_MPI
  GTEST_SKIP() << "this build has no mpi backend";
#endif
  const std::string logs = make_temp_dir("mpi-redirects");
  struct Removed {
    std::string dir;
    ~Removed() { remove_tree(dir); }
  } removed{logs};
  expect_rank_1_stderr_on_console({"--backend", "mpi"}, logs);
}

TEST(Launch, MpiWorkerFailureEndsTheJob) {
#ifndef PARATRAIN_WITH_MPI
  GTEST_SKIP() << "this build has no mpi backend";
#endif
  std::string token = unique_token("mpiexit");
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "2", "--backend", "mpi", "--",
                        probe_path(), "exit", "1", "3", token},
                       {}, 60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("job failed: rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  expect_no_leftovers(token);
}

// A script written for torch.distributed.launch reads args.local_rank: --pass-local-rank appends
// --local_rank=N after its own arguments, as that launcher did; without it every rank would take
// the default, 0, which the script refuses.
TEST(Launch, PassLocalRankServesTorchDistributedLaunchScripts) {
  if (!python_has("torch")) {
    GTEST_SKIP() << test_python() << " has no torch (Debian's python3-torch) to run the script";
  }
  const std::string script =
      std::string(PARATRAIN_TEST_DATA_DIR) + "/../launch/local_rank_script.py";
  auto run = [&](bool pass) {
    std::vector<std::string> argv{cli_path(), "launch", "--standalone", "--nproc-per-node", "3"};
    if (pass) {
      argv.push_back("--pass-local-rank");
    }
    argv.insert(argv.end(), {"--", test_python(), script, "--tag", "x"});
    // Debian 13's PyTorch is built without libuv, which its TCPStore asks for unless USE_LIBUV=0.
    return run_process(argv, {{"OMP_NUM_THREADS", "1"}, {"USE_LIBUV", "0"}}, 180);
  };
  auto r = run(true);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(
        r.output.find("[rank " + std::to_string(rank) + "]: rank " + std::to_string(rank) +
                      ": local_rank " + std::to_string(rank) + " agrees with LOCAL_RANK (tag x)"),
        std::string::npos)
        << r.output;
  }
  r = run(false);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("--local_rank=0 but LOCAL_RANK="), std::string::npos) << r.output;
}

// ---- Bad input: the program, the limits ---------------------------------------------------------

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++n;
  }
  return n;
}

// A script without its execute bit is named as such, with the two ways to run it, whether given
// by its path or found on PATH by its name.
TEST(Launch, ProgramWithoutExecuteBitIsNamed) {
  const std::string dir = make_temp_dir("launch-noexec");
  const std::string script = dir + "/train.sh";
  std::ofstream(script) << "#!/bin/bash\necho hi\n";
  ASSERT_EQ(::chmod(script.c_str(), 0644), 0);
  auto r = run_cli({cli_path(), "launch", "--", script});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("paratrain launch: error: program '" + script +
                          "' exists but is not executable: make it so (chmod +x " + script +
                          ") or run it through its interpreter (-- /bin/bash " + script + ")"),
            std::string::npos)
      << r.output;
  r = run_cli({cli_path(), "launch", "--", "train.sh"}, {{"PATH", dir}});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("program 'train.sh' is on PATH as " + script +
                          ", which exists but is not executable: make it so (chmod +x " + script),
            std::string::npos)
      << r.output;
  remove_tree(dir);
}

// The launcher's own errors reach the command line once prefixed, whichever depth throws them:
// the options' checks, the start of the workers, the command line's parsing.
TEST(Launch, ErrorsNameTheCommandOnce) {
  const std::string dir = make_temp_dir("launch-errors");
  { std::ofstream(dir + "/file") << "not a folder\n"; }
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases{
      {{"--", "/no/such/program"}, "program '/no/such/program' not found: no such file"},
      {{"--", dir}, "program '" + dir + "' is a directory, not a program"},
      {{"--log-dir", dir + "/file", "--", "/bin/true"},
       "--log-dir '" + dir + "/file' is not a directory and cannot be created"},
      {{"--nproc-per-node", "2"}, "no program given"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "launch"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_cli(argv);
    EXPECT_NE(r.exit_code, 0) << c.message;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.output;
    EXPECT_EQ(count_of(r.output, "paratrain launch:"), 1u) << r.output;
    EXPECT_EQ(count_of(r.output, "\n"), 1u) << r.output;
  }
  remove_tree(dir);
}

// `ulimit -n` sets both limits: 40 workers need about 100 open files in the launcher (a pipe per
// output stream of each), more than 64. Refused at once, naming the option and the limit, with
// nothing started; before, the launcher forked until a pipe failed.
TEST(Launch, WorkersBeyondTheOpenFilesLimitAreRefusedAtOnce) {
  const std::string token = unique_token("nofile");
  const auto start = std::chrono::steady_clock::now();
  auto r = run_process({"/bin/sh", "-c", "ulimit -n 64 && exec \"$@\"", "sh", cli_path(), "launch",
                        "--nproc-per-node", "40", "--", probe_path(), "env", token},
                       {}, 60);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("paratrain launch: error: --nproc-per-node 40 needs about "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("but its limit is 64 (ulimit -Hn): raise it (ulimit -n "),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_of(r.output, "\n"), 1u) << r.output;
  EXPECT_EQ(r.output.find("[rank"), std::string::npos) << "a worker was started: " << r.output;
  EXPECT_LT(seconds, 5.0) << r.output;
}

// Under the hard limit, the launcher raises its soft limit for the workers' pipes; the workers
// keep the soft limit they would have had (select() cannot watch descriptors from 1024 on).
TEST(Launch, RaisesItsOwnOpenFilesLimitForManyWorkersButNotTheirs) {
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_max < 512) {
    GTEST_SKIP() << "the hard limit of open files here is " << lim.rlim_max << ", under 512";
  }
  auto r = run_process({"/bin/sh", "-c", "ulimit -Sn 64 && exec \"$@\"", "sh", cli_path(), "launch",
                        "--nproc-per-node", "40", "--", "/bin/sh", "-c", "ulimit -Sn"},
                       {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 40; ++rank) {
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "]: 64\n"), std::string::npos)
        << r.output;
  }
}

// ---- What the workers leave running ---------------------------------------------------------

// A sleep of a length no other process has, to find it by its command line afterwards.
std::string leftover_seconds() {
  static int n = 0;
  return "4747" + std::to_string(::getpid()) + "." + std::to_string(++n);
}

// Shell lines that leave `sleep $LEFTOVER` running in a session of its own, as a daemon, which the
// worker's process group does not hold; they wait until it has its session (its id is its pid).
const std::string kLeaveASleep =
    "setsid sleep \"$LEFTOVER\" & "
    "until [ \"$(cut -d' ' -f6 /proc/$!/stat)\" = \"$!\" ]; do sleep 0.01; done; ";

TEST(Launch, WhatWorkersLeaveRunningEndsWithTheJob) {
  const std::string left = leftover_seconds();
  auto r = run_process({cli_path(), "launch", "--nproc-per-node", "2", "--", "/bin/sh", "-c",
                        kLeaveASleep + "exit 0"},
                       {{"LEFTOVER", left}}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("paratrain launch: stopped 2 processes that the workers left running: "),
            std::string::npos)
      << r.output;
  expect_no_leftovers(left);
}

// A failed attempt's leftovers are gone before the next attempt starts, and the last attempt's
// when the job ends.
TEST(Launch, WhatAFailedAttemptLeftRunningEndsBeforeTheRestart) {
  const std::string first = leftover_seconds();
  const std::string second = leftover_seconds();
  const std::string pid_file = "/tmp/" + unique_token("leftover-pid");
  const std::string script =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then LEFTOVER=$FIRST; " + kLeaveASleep +
      "echo $! > \"$PID_FILE\"; exit 3; fi; "
      "if kill -0 \"$(cat \"$PID_FILE\")\" 2>/dev/null; then echo 'attempt 0 left it running'; fi; "
      "LEFTOVER=$SECOND; " +
      kLeaveASleep + "exit 0";
  const std::string logs = make_temp_dir("attempt-logs");
  auto r = run_process({cli_path(), "launch", "--max-restarts", "1", "--log-dir", logs, "--",
                        "/bin/sh", "-c", "echo attempt $TORCHELASTIC_RESTART_COUNT >&2; " + script},
                       {{"FIRST", first}, {"SECOND", second}, {"PID_FILE", pid_file}}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("restarting all (restart 1 of 1)"), std::string::npos) << r.output;
  // Each attempt's logs in a folder of its own: the restart keeps the failed attempt's.
  const std::string run = run_folder(logs);
  EXPECT_EQ(file_text(run + "/attempt_0/0/stderr.log"), "attempt 0\n");
  EXPECT_EQ(file_text(run + "/attempt_1/0/stderr.log"), "attempt 1\n");
  remove_tree(logs);
  EXPECT_EQ(r.output.find("attempt 0 left it running"), std::string::npos) << r.output;
  expect_no_leftovers(first);
  expect_no_leftovers(second);
  std::remove(pid_file.c_str());
}

TEST(Launch, WhatWorkersLeaveRunningEndsWhenTheLauncherIsInterrupted) {
  const std::string left = leftover_seconds();
  RunningProcess p = start_process(
      {cli_path(), "launch", "--", "/bin/sh", "-c", kLeaveASleep + "echo ready; exec sleep 600"},
      {{"LEFTOVER", left}});
  ASSERT_TRUE(p.wait_for_output("[rank 0]: ready", 30)) << p.output;
  ::kill(p.pid, SIGINT);
  ProcessResult r = p.finish(30);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.output;
  expect_no_leftovers(left);
}

TEST(Spawn, ChildrenRunAndParentContinues) {
  auto r = run_process({spawn_probe_path(), "2"}, {{"PARATRAIN_TIMEOUT", "60"}}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: child 0 of 2 sum 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: child 1 of 2 sum 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("parent: all 2 children done"), std::string::npos) << r.output;
  // The parent line comes once: children never return into main().
  EXPECT_EQ(r.output.find("parent:"), r.output.rfind("parent:")) << r.output;
}

TEST(Spawn, FailingChildIsReported) {
  auto r = run_process({spawn_probe_path(), "3", "fail"}, {{"PARATRAIN_TIMEOUT", "20"}}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: error: child 1 fails on purpose"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("parent: spawn failed: paratrain spawn: job failed: rank 1"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
