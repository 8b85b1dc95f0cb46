// Every collective on 1, 2 and 3 real processes per backend, each rank checking its results
// against values computed locally (see programs/collective_worker.cpp for the checks).

#include "test_util.h"

#include <gtest/gtest.h>

#include <fstream>

#include <cctype>

namespace paratrain {
namespace testing {
namespace {

struct Case {
  std::string backend;
  int ranks;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " with " << c.ranks << " ranks";
}

class Collectives : public ::testing::TestWithParam<Case> {};

TEST_P(Collectives, MatchLocalResults) {
  const Case c = GetParam();
  auto r = run_process(
      {cli_path(), "launch", "--standalone", "--nproc-per-node", std::to_string(c.ranks),
       "--backend", c.backend, "--", worker_path(), "collectives"},
      {{"PARATRAIN_TIMEOUT", "60"}}, 240);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < c.ranks; ++rank) {
    std::string line = "[rank " + std::to_string(rank) + "]: rank " + std::to_string(rank) +
                       " of " + std::to_string(c.ranks) + " (" + c.backend +
                       "): all collectives ok";
    EXPECT_NE(r.output.find(line), std::string::npos) << "missing '" << line << "' in\n"
                                                      << r.output;
  }
  EXPECT_EQ(r.output.find("MISMATCH"), std::string::npos) << r.output;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  std::vector<std::string> backends{"gloo"};
#ifdef PARATRAIN_WITH_MPI
  backends.push_back("mpi");
#endif
  for (const auto& b : backends) {
    for (int n : {1, 2, 3}) {
      out.push_back({b, n});
    }
  }
  // Routed groups (torch.distributed 2.x's "cpu:gloo,cuda:nccl"): CPU tensors take the cpu route.
  out.push_back({"cpu:gloo", 2});
#ifdef PARATRAIN_WITH_MPI
  out.push_back({"cpu:mpi", 2});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(Backends,
                         Collectives,
                         ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.backend;
                           for (char& ch : name) {
                             ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           }
                           return name + "_" + std::to_string(info.param.ranks) + "ranks";
                         });

// PyTorch's results for `ranks` ranks (tests/comm/collectives_reference.py on gloo), then
// paratrain's on `backend` compared with them on every rank, together with its bad-input checks.
void expect_pytorch_results(const std::string& backend, int ranks) {
  const std::string dir = make_temp_dir("collectives-reference");
  auto made = run_process(
      {test_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/../comm/collectives_reference.py",
       std::to_string(ranks), dir},
      {}, 180);
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto r =
      run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", std::to_string(ranks),
                   "--backend", backend, "--", worker_path(), "reference", dir},
                  {{"PARATRAIN_TIMEOUT", "60"}}, 240);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("MISMATCH"), std::string::npos) << r.output;
  for (int rank = 0; rank < ranks; ++rank) {
    const std::string line = "[rank " + std::to_string(rank) + "]: rank " + std::to_string(rank) +
                             " of " + std::to_string(ranks) + " (" + backend + "): ";
    EXPECT_NE(r.output.find(line), std::string::npos) << "missing '" << line << "' in\n"
                                                      << r.output;
  }
  EXPECT_NE(r.output.find("results equal PyTorch's"), std::string::npos) << r.output;
  remove_tree(dir);
}

TEST(Collectives, MatchPyTorchOnGloo) {  // ctest: slow 60
  if (!python_has("torch")) {
    GTEST_SKIP() << test_python() << " has no torch to compute the expected results";
  }
  for (int ranks : {2, 3, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    expect_pytorch_results("gloo", ranks);
  }
}

#ifdef PARATRAIN_WITH_MPI
TEST(Collectives, MatchPyTorchOnMpi) {  // ctest: slow 60
  if (!python_has("torch")) {
    GTEST_SKIP() << test_python() << " has no torch to compute the expected results";
  }
  for (int ranks : {2, 3, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    expect_pytorch_results("mpi", ranks);
  }
}
#endif

// Rank 2 comes 4 s late to a monitored_barrier with a 1.5 s timeout: every rank's error names it
// (rank 2's own says that rank 0 did not let it pass, or names itself).
TEST(BadInput, MonitoredBarrierNamesTheLateRank) {  // ctest: slow 20
  std::vector<std::string> backends{"gloo"};
#ifdef PARATRAIN_WITH_MPI
  backends.push_back("mpi");
#endif
  for (const auto& backend : backends) {
    auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "3",
                          "--backend", backend, "--", worker_path(), "monitored", "2"},
                         {{"PARATRAIN_TIMEOUT", "60"}}, 120);
    ASSERT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_NE(r.output.find("rank " + std::to_string(rank) + " passed the monitored barrier"),
                std::string::npos)
          << r.output;
    }
    for (int rank = 0; rank < 2; ++rank) {
      const std::string line = "rank " + std::to_string(rank) + " error: monitored_barrier #";
      const auto at = r.output.find(line);
      ASSERT_NE(at, std::string::npos) << backend << ": " << r.output;
      EXPECT_NE(r.output.substr(at, r.output.find('\n', at) - at)
                    .find("failed: rank 2 did not reach it within 1500 ms"),
                std::string::npos)
          << backend << ": " << r.output;
    }
    EXPECT_NE(r.output.find("rank 2 error: monitored_barrier #"), std::string::npos)
        << backend << ": " << r.output;
    EXPECT_EQ(r.output.find("passed the second monitored barrier"), std::string::npos)
        << backend << ": " << r.output;
  }
}

TEST(WorldOfOne, RunsWithoutAnyLauncher) {
  // No RANK, WORLD_SIZE or MASTER_ADDR: a plain program is a world of one, with no network.
  auto r = run_process({worker_path(), "collectives"}, world_of_one_env(), 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0 of 1 (" + auto_backend("gloo") + "): all collectives ok"),
            std::string::npos)
      << r.output;
}

TEST(Example, AllreduceSmokeUnderLaunchAndMpirun) {
  auto r = run_process(
      {cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--", PARATRAIN_TEST_SMOKE},
      {{"PARATRAIN_TIMEOUT", "60"}}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: rank 1 of 2 (" + auto_backend("gloo") +
                          "): allreduce sum = 3, expected 3 ok"),
            std::string::npos)
      << r.output;
#ifdef PARATRAIN_WITH_MPI
  // Plain mpirun, no paratrain launcher and no PARATRAIN_BACKEND: "auto" must pick mpi.
  std::vector<std::string> argv{"/usr/bin/mpirun", "-np", "2", "--oversubscribe"};
  argv.push_back("--allow-run-as-root");
  argv.push_back(PARATRAIN_TEST_SMOKE);
  r = run_process(argv,
                  {{"PARATRAIN_BACKEND", "<unset>"},
                   {"RANK", "<unset>"},
                   {"WORLD_SIZE", "<unset>"},
                   // With a GPU, "auto" under mpirun is cpu:mpi,cuda:nccl: NCCL meets over a store.
                   {"MASTER_PORT", std::to_string(free_port())},
                   {"PARATRAIN_TIMEOUT", "60"}},
                  120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(
      r.output.find("rank 0 of 2 (" + auto_backend("mpi") + "): allreduce sum = 3, expected 3 ok"),
      std::string::npos)
      << r.output;
#endif
}

TEST(Bench, AllreduceJsonRows) {
  // Not a timing test: the benchmark runs end to end and its --json rows carry the promised fields.
  auto r = run_process({cli_path(), "bench", "allreduce", "--json", "--min-bytes", "1K",
                        "--max-bytes", "4K", "--iters", "3"},
                       {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> backends{"gloo"};
#ifdef PARATRAIN_WITH_MPI
  backends.push_back("mpi");
#endif
  for (const auto& b : backends) {
    for (const char* bytes : {"1024", "4096"}) {
      std::string row = "{\"benchmark\": \"allreduce\", \"backend\": \"" + b +
                        "\", \"ranks\": 2, \"bytes\": " + bytes + ", \"seconds\": ";
      EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
    }
  }
  EXPECT_NE(r.output.find("\"busbw_gbps\": "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"backend\": \"memcpy\""), std::string::npos) << r.output;
#ifdef PARATRAIN_WITH_MPI
  EXPECT_NE(r.output.find("\"comparison\": \"mpi/gloo\""), std::string::npos) << r.output;
#endif
  for (char c : r.output) {
    ASSERT_NE(c, '[') << "--json output must hold only JSON rows:\n" << r.output;
  }
}

TEST(Bench, DdpJsonRows) {
  // Not a timing test: the DDP benchmark runs end to end (paratrain, independent trainers and
  // PyTorch's DDP through Debian's python3-torch) and its rows carry the promised fields.
  if (!python_has("torch")) {
    GTEST_SKIP() << test_python() << " has no torch for the PyTorch DDP row";
  }
  auto r = run_process({cli_path(), "bench", "ddp", "--workloads", "mlp", "--steps", "3", "--json",
                        "--python", test_python()},
                       {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // PyTorch's row is named by its version (pytorch-1.13.1).
  for (const char* system : {"paratrain\"", "independent\"", "pytorch-"}) {
    std::string tag = std::string("\"system\": \"") + system;
    EXPECT_NE(r.output.find(tag), std::string::npos) << tag << "\n" << r.output;
  }
  for (const char* key :
       {"\"workload\": \"mlp\"", "\"ranks\": 2", "\"step_seconds\": ", "\"ratio_to_independent\": ",
        "\"ratio_to_pytorch\": ", "\"hidden_comm_fraction\": "}) {
    EXPECT_NE(r.output.find(key), std::string::npos) << key << "\n" << r.output;
  }
}

TEST(Bench, DdpTraceShowsTheWaitAfterBackward) {
  // bench ddp --trace: every rank's timed steps in one trace, with DDP's exposed wait, and the
  // report's share of the allreduce time that backward hides.
  const std::string trace = "/tmp/" + unique_token("bench-ddp-trace") + ".json";
  // One backend: with several, each writes a file of its own (trace.gloo.json, ...).
  auto r = run_process({cli_path(), "bench", "ddp", "--workloads", "mlp", "--steps", "3", "--json",
                        "--no-pytorch", "--backend", "gloo", "--trace", trace},
                       {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* key : {"\"trace_hidden_fraction\": ", "\"trace_exposed_seconds\": "}) {
    EXPECT_NE(r.output.find(key), std::string::npos) << key << "\n" << r.output;
  }
  std::ifstream in(trace);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
      ++n;
    }
    return n;
  };
  EXPECT_EQ(count("\"name\":\"backward\""), 6u) << "3 timed steps on 2 ranks";
  EXPECT_EQ(count("\"name\":\"allreduce wait (exposed)\""), 6u);
  EXPECT_EQ(count("\"name\":\"allreduce bucket 0\""), 6u);
  EXPECT_EQ(count("\"name\":\"rank 1\""), 1u) << "rank 1's process is named";
  std::remove(trace.c_str());
}

TEST(InitMethods, TcpAndFile) {
  // tcp://host:port and file:// through the smoke example's sibling: the worker reads the init
  // method from PARATRAIN_INIT_METHOD.
  int port = free_port();
  for (const std::string& method :
       {"tcp://127.0.0.1:" + std::to_string(port),
        std::string("file://") + "/tmp/" + unique_token("paratrain-filestore")}) {
    auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                          worker_path(), "init"},
                         {{"PARATRAIN_INIT_METHOD", method}, {"PARATRAIN_TIMEOUT", "30"}}, 120);
    EXPECT_EQ(r.exit_code, 0) << method << "\n" << r.output;
    EXPECT_NE(r.output.find("rank 1 of 2 joined (" + auto_backend("gloo") + ")"), std::string::npos)
        << r.output;
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
