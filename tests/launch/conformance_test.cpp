// torchrun (PyPI's torch) and paratrain launch run the same Python script with the same flags, and
// every worker's environment contract and arguments are compared key by key. The keys that differ
// on purpose are listed below with their reason, as docs/launch.md lists them for users.

#include "fake_hosts.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

// Keys whose values differ by design (docs/launch.md, "torchrun's environment").
const std::map<std::string, std::string> kDiffer{
    {"OMP_NUM_THREADS", "torchrun sets 1; paratrain the cores divided by the local workers"},
    {"TORCHELASTIC_USE_AGENT_STORE", "rank 0 serves the workers' store, not the launcher"},
    {"TORCHELASTIC_ERROR_FILE", "torchrun's error files for Python's @record; paratrain has none"},
    {"TORCHELASTIC_SIGNALS_TO_HANDLE", "torchrun's agent's signal list"},
    {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "a PyTorch NCCL setting torchrun makes for Python workers"},
    {"PYTHONUNBUFFERED", "torchrun runs Python; paratrain runs -u with -m and --run-path"},
};

// rank -> (key -> value) from the "[rank R]: ENV K=V ... ARGS=a,b" lines, or the unprefixed
// lines of torchrun in the order of their RANK.
std::map<std::string, std::map<std::string, std::string>> contracts(const std::string& output) {
  std::map<std::string, std::map<std::string, std::string>> out;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find("ENV ");
    if (at == std::string::npos) {
      continue;
    }
    std::map<std::string, std::string> vars;
    std::istringstream words(line.substr(at + 4));
    for (std::string word; words >> word;) {
      const size_t eq = word.find('=');
      vars[word.substr(0, eq)] = eq == std::string::npos ? "" : word.substr(eq + 1);
    }
    out[vars["RANK"] + "/" + vars["TORCHELASTIC_RESTART_COUNT"]] = vars;
  }
  return out;
}

// Keys whose values differ under a dynamic rendezvous only: each launcher places the workers' store
// itself (docs/launch.md, "torchrun's environment").
const std::map<std::string, std::string> kDifferDynamic{
    {"MASTER_ADDR", "the workers' store: torchrun's agent's getfqdn(), paratrain rank 0's address"},
    {"MASTER_PORT", "the workers' store: a free port, picked by each launcher"},
};

// `launcher`'s command line (torchrun, or paratrain launch) for `flags` and the script.
std::vector<std::string> command(bool torchrun, const std::vector<std::string>& flags) {
  const std::string script = std::string(PARATRAIN_TEST_DATA_DIR) + "/../launch/envprint.py";
  std::vector<std::string> argv{
      torchrun ? hf_python().substr(0, hf_python().rfind('/')) + "/torchrun" : cli_path()};
  if (!torchrun) {
    argv.push_back("launch");
  }
  argv.insert(argv.end(), flags.begin(), flags.end());
  if (!torchrun) {
    argv.insert(argv.end(), {"--run-path", "--"});
  }
  argv.insert(argv.end(), {script, "a", "b"});
  return argv;
}

// One job: the launcher of node k with flags(k), on this machine (no hosts) or on host k. The
// outputs are joined; the exit code is the first non-zero one. When node 0's launcher failed, the
// others (waiting for it) get 5 s; none outlives the call.
ProcessResult run_job(bool torchrun,
                      const std::function<std::vector<std::string>(int)>& flags,
                      const cli::FakeHosts* hosts,
                      const std::map<std::string, std::string>& env) {
  if (hosts == nullptr) {
    return run_process(command(torchrun, flags(0)), env, 120);
  }
  struct Others {
    std::vector<RunningProcess> running;
    ~Others() {
      for (auto& p : running) {
        if (p.pid > 0) {
          p.finish(0);  // killed and reaped, should node 0's run have thrown
        }
      }
    }
  } others;
  for (int k = 1; k < hosts->size(); ++k) {
    others.running.push_back(start_process(hosts->exec(k, command(torchrun, flags(k))), env));
  }
  ProcessResult all = run_process(hosts->exec(0, command(torchrun, flags(0))), env, 60);
  for (auto& p : others.running) {
    const ProcessResult r = p.finish(all.exit_code == 0 ? 60 : 5);
    p.pid = -1;
    all.output += r.output;
    all.exit_code = all.exit_code != 0 ? all.exit_code : r.exit_code;
  }
  others.running.clear();
  return all;
}

void expect_same_contract(const std::function<std::vector<std::string>(int)>& flags,
                          const std::string& what,
                          size_t workers,
                          const cli::FakeHosts* hosts = nullptr,
                          const std::map<std::string, std::string>& differ = {}) {
  const std::map<std::string, std::string> env{{"FAIL_FIRST", what == "restart" ? "1" : ""}};
  const ProcessResult t = run_job(true, flags, hosts, env);
  const ProcessResult p = run_job(false, flags, hosts, env);
  const auto want = contracts(t.output);
  const auto got = contracts(p.output);
  ASSERT_EQ(want.size(), workers) << what << ": torchrun's output:\n" << t.output;
  ASSERT_EQ(got.size(), workers) << what << ": paratrain's output:\n" << p.output;
  EXPECT_EQ(t.exit_code, p.exit_code) << t.output << "\n" << p.output;
  for (const auto& [worker, vars] : want) {
    const auto mine = got.find(worker);
    ASSERT_NE(mine, got.end()) << what << ": no worker " << worker << " in\n" << p.output;
    std::set<std::string> keys;
    for (const auto& kv : vars) {
      keys.insert(kv.first);
    }
    for (const auto& kv : mine->second) {
      keys.insert(kv.first);
    }
    for (const auto& key : keys) {
      if (kDiffer.count(key) != 0 || differ.count(key) != 0) {
        continue;
      }
      const auto a = vars.find(key);
      const auto b = mine->second.find(key);
      EXPECT_TRUE(a != vars.end() && b != mine->second.end() && a->second == b->second)
          << what << ", worker " << worker << ": " << key << " is '"
          << (a == vars.end() ? "<unset>" : a->second) << "' under torchrun and '"
          << (b == mine->second.end() ? "<unset>" : b->second) << "' under paratrain launch";
    }
  }
}

std::function<std::vector<std::string>(int)> same(const std::vector<std::string>& flags) {
  return [flags](int) { return flags; };
}

#define SKIP_WITHOUT_TORCHRUN()                                                    \
  do {                                                                             \
    if (!hf_python_missing().empty()) {                                            \
      GTEST_SKIP() << "no PyPI torch with torchrun here: " << hf_python_missing(); \
    }                                                                              \
  } while (0)

TEST(Conformance, TorchrunEnvironmentKeyByKey) {  // ctest: slow 40
  SKIP_WITHOUT_TORCHRUN();
  const std::string port = std::to_string(free_port());
  expect_same_contract(same({"--nproc-per-node", "2", "--master-port", port}), "static", 2);
  expect_same_contract(same({"--nproc-per-node", "2", "--master-port", port, "--rdzv-id", "job7",
                             "--role", "trainer"}),
                       "named", 2);
  // A first attempt that fails, then a restart: both attempts' contracts.
  expect_same_contract(
      same({"--nproc-per-node", "2", "--master-port", port, "--max-restarts", "1"}), "restart", 4);
}

// The dynamic rendezvous (torchrun's c10d): the launcher on the endpoint's host serves it.
TEST(Conformance, TorchrunEnvironmentUnderC10dRendezvous) {  // ctest: slow 30
  SKIP_WITHOUT_TORCHRUN();
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  expect_same_contract(same({"--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", endpoint, "--rdzv-id", "job9"}),
                       "c10d", 2, nullptr, kDifferDynamic);
}

// Two nodes of a static job, each launcher on a host of its own (network namespaces).
TEST(Conformance, TorchrunEnvironmentOnTwoHosts) {  // ctest: slow 40
  SKIP_WITHOUT_TORCHRUN();
  const std::string why = cli::FakeHosts::unavailable_reason();
  if (!why.empty()) {
    GTEST_SKIP() << why;
  }
  cli::FakeHosts hosts(2);
  const std::string port = std::to_string(free_port());
  expect_same_contract(
      [&](int k) {
        return std::vector<std::string>{"--nnodes",         "2",
                                        "--nproc-per-node", "2",
                                        "--node-rank",      std::to_string(k),
                                        "--master-addr",    hosts.address(0),
                                        "--master-port",    port};
      },
      "two hosts", 4, &hosts);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
