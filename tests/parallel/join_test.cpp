// Uneven inputs under Join, with real ranks on loopback: programs/join_worker gives every rank a
// different number of batches and checks its final parameters against a one-process replay (see
// its header), under DDP alone, with SyncBatchNorm, and with ZeroRedundancyOptimizer.

#include "test_util.h"

#include <paratrain/parallel/join.h>

#include <gtest/gtest.h>

namespace paratrain {
namespace testing {
namespace {

struct JoinCase {
  std::string name;
  std::string backend;
  int ranks;
  std::vector<std::string> args;
};

void PrintTo(const JoinCase& c, std::ostream* os) {
  *os << c.name << " on " << c.ranks << " " << c.backend << " ranks";
}

class JoinUneven : public ::testing::TestWithParam<JoinCase> {};

TEST_P(JoinUneven, NeitherHangsNorDropsGradients) {
  const JoinCase& c = GetParam();
  expect_every_rank_ok(PARATRAIN_TEST_JOIN_WORKER, c.backend, c.ranks, c.args);
}

std::vector<JoinCase> join_cases() {
  std::vector<JoinCase> out{
      {"ddp", "gloo", 3, {"--model", "mlp"}},
      {"ddp_syncbn", "gloo", 3, {"--model", "syncbn"}},
      {"ddp_zero", "gloo", 3, {"--model", "mlp", "--zero"}},
      {"ddp_syncbn_zero", "gloo", 2, {"--model", "syncbn", "--zero", "--extra", "3"}},
  };
#ifdef PARATRAIN_WITH_MPI
  out.push_back({"ddp_syncbn_zero", "mpi", 3, {"--model", "syncbn", "--zero"}});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases,
                         JoinUneven,
                         ::testing::ValuesIn(join_cases()),
                         [](const ::testing::TestParamInfo<JoinCase>& info) {
                           return info.param.name + "_" + info.param.backend + "_" +
                                  std::to_string(info.param.ranks) + "ranks";
                         });

TEST(Join, BadInput) {
  EXPECT_NE(error_of([] { Join join(nullptr, [] {}); }).find("process group is null"),
            std::string::npos);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
