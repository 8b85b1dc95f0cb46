// Every benchmark of paratrain-bench runs end to end at its smallest (--smoke) and prints JSON
// rows, one case per benchmark so that a failure names it. Not a timing test: a smoke run's numbers
// mean nothing. What is checked is that each benchmark's code paths run to the end and that its
// --json output is rows, each a JSON object (`bench amp --json` once appended text to an unfinished
// row).

#include "test_util.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sstream>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

class BenchSmoke : public ::testing::TestWithParam<std::string> {};

TEST_P(BenchSmoke, WritesJsonRows) {
  const std::string& name = GetParam();
  auto r = run_process({cli_path(), "bench", name, "--json", "--smoke"},
                       {{"OMP_NUM_THREADS", "1"}, kCpuOnly}, 180);
  ASSERT_FALSE(r.timed_out) << "bench " << name << " --smoke ran past 180 s:\n" << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // run_process merges stdout and stderr, and a benchmark's progress goes to stderr under --json:
  // the rows are the lines that start with '{'.
  std::istringstream lines(r.output);
  int rows = 0;
  std::string unavailable;  // the benchmark's one line saying why it cannot run here
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("{", 0) == 0) {
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      EXPECT_TRUE(row.is_object()) << "bench " << name << " printed a row that is not a JSON "
                                   << "object: " << line;
      ++rows;
    } else if (line.find(": not available here: ") != std::string::npos) {
      unavailable = line;
    }
  }
  if (rows == 0 && !unavailable.empty()) {
    GTEST_SKIP() << unavailable;
  }
  EXPECT_GT(rows, 0) << "bench " << name << " --json --smoke printed no row:\n" << r.output;
}

// With --python, a benchmark runs the anchor's side and names its rows by the version that ran
// (bench/anchors.h): `bench data`, the quickest with a PyTorch side, against Debian's PyTorch,
// whose torch reports 1.13.0a0 for its 1.13.1. The target row compares with that anchor.
TEST(BenchAnchors, RowsCarryTheAnchorsVersionAndTheTarget) {
  const std::string python = "/usr/bin/python3";
  if (run_process({python, "-c", "import torch, torchvision"}, {}, 60).exit_code != 0) {
    GTEST_SKIP() << python << " has no torch and torchvision (python3-torchvision)";
  }
  auto r = run_process({cli_path(), "bench", "data", "--json", "--smoke", "--python", python},
                       {{"OMP_NUM_THREADS", "1"}, kCpuOnly}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream lines(r.output);
  std::string anchor;  // the anchor row's system
  bool target = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("{", 0) != 0) {
      continue;
    }
    const nlohmann::json row = nlohmann::json::parse(line);
    const std::string system = row.value("system", "");
    if (system.rfind("pytorch-", 0) == 0) {
      anchor = system;
      EXPECT_EQ("pytorch-" + row.value("anchor_version", "").substr(0, system.size() - 8), system)
          << line;
      EXPECT_EQ(row.value("anchor_python", ""), python) << line;
      EXPECT_EQ(system.find("a0"), std::string::npos) << "the release, not the build's version";
    }
    if (row.contains("target")) {
      target = true;
      EXPECT_EQ(row.value("against", ""), anchor) << line;
      EXPECT_TRUE(row.contains("ratio") && row.contains("met")) << line;
    }
  }
  EXPECT_FALSE(anchor.empty()) << "no PyTorch row:\n" << r.output;
  EXPECT_TRUE(target) << "no target row:\n" << r.output;
}

// The benchmarks of bench/main.cpp's table.
// ctest: slow 30 Benchmarks/BenchSmoke.WritesJsonRows/cluster
// ctest: slow 15 Benchmarks/BenchSmoke.WritesJsonRows/faults
INSTANTIATE_TEST_SUITE_P(Benchmarks,
                         BenchSmoke,
                         ::testing::Values("allreduce",
                                           "ddp",
                                           "strategies",
                                           "pipeline",
                                           "amp",
                                           "amp-accuracy",
                                           "faults",
                                           "tune",
                                           "cluster",
                                           "fsdp",
                                           "parallel",
                                           "optim",
                                           "offload",
                                           "data"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;  // amp-accuracy: amp_accuracy
                           for (char& ch : name) {
                             ch = ch == '-' ? '_' : ch;
                           }
                           return name;
                         });

}  // namespace
}  // namespace testing
}  // namespace paratrain
