// torchrun (PyPI's torch) and paratrain launch run the same Python script with the same flags, and
// every worker's environment contract and arguments are compared key by key. The keys that differ
// on purpose are listed below with their reason, as docs/launch.md lists them for users.

#include "test_util.h"

#include <gtest/gtest.h>

#include <unistd.h>

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

void expect_same_contract(const std::vector<std::string>& flags,
                          const std::string& what,
                          size_t workers) {
  const std::string torchrun = hf_python().substr(0, hf_python().rfind('/')) + "/torchrun";
  const std::string script = std::string(PARATRAIN_TEST_DATA_DIR) + "/../launch/envprint.py";
  std::vector<std::string> theirs{torchrun};
  theirs.insert(theirs.end(), flags.begin(), flags.end());
  theirs.insert(theirs.end(), {script, "a", "b"});
  std::vector<std::string> ours{cli_path(), "launch"};
  ours.insert(ours.end(), flags.begin(), flags.end());
  ours.insert(ours.end(), {"--run-path", "--", script, "a", "b"});
  const std::map<std::string, std::string> env{{"FAIL_FIRST", what == "restart" ? "1" : ""}};
  auto t = run_process(theirs, env, 180);
  auto p = run_process(ours, env, 180);
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
      if (kDiffer.count(key) != 0) {
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

TEST(Conformance, TorchrunEnvironmentKeyByKey) {  // ctest: slow 40
  if (!hf_python_missing().empty()) {
    GTEST_SKIP() << "no PyPI torch with torchrun here: " << hf_python_missing();
  }
  const std::string port = std::to_string(free_port());
  expect_same_contract({"--nproc-per-node", "2", "--master-port", port}, "static", 2);
  expect_same_contract(
      {"--nproc-per-node", "2", "--master-port", port, "--rdzv-id", "job7", "--role", "trainer"},
      "named", 2);
  // A first attempt that fails, then a restart: both attempts' contracts.
  expect_same_contract({"--nproc-per-node", "2", "--master-port", port, "--max-restarts", "1"},
                       "restart", 4);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
