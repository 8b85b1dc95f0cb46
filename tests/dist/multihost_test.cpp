// Several hosts, for real: each host is a network namespace with its own address (bench's
// FakeHosts), each runs its own `paratrain launch`, and the ranks meet over the namespaces' bridge
// as they would over a LAN. The DDP workers check themselves against single-process training.
// Needs root (network namespaces); without it each test skips and says so.

#include "fake_hosts.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdio>
#include <fstream>

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

void expect_ddp_across_hosts(const std::string& backend) {
  FakeHosts hosts(2);
  auto results = run_on_hosts(hosts,
                              [&](int k) {
                                return std::vector<std::string>{cli_path(),
                                                                "launch",
                                                                "--nnodes",
                                                                "2",
                                                                "--nproc-per-node",
                                                                "2",
                                                                "--node-rank",
                                                                std::to_string(k),
                                                                "--master-addr",
                                                                hosts.address(0),
                                                                "--master-port",
                                                                "29500",
                                                                "--backend",
                                                                backend,
                                                                "--",
                                                                PARATRAIN_TEST_DDP_WORKER};
                              },
                              {{"PARATRAIN_TIMEOUT", "60"}});
  expect_ranks_ok(results, 4);
}

TEST(MultiHost, DdpOnGlooAcrossTwoHostsEqualsOneProcess) {
  SKIP_WITHOUT_NAMESPACES();
  expect_ddp_across_hosts("gloo");
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
    auto r = run_process(argv, {}, 60);
    EXPECT_NE(r.exit_code, 0) << c.contents;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.message << "\n" << r.output;
  }
  std::remove((base + ".hosts").c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
