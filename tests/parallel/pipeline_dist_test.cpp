// Pipelines over real processes on loopback: one stage per rank (2 and 3 stages, gloo and mpi,
// GPipe and 1F1B, with recomputation), and 2-D parallelism (2 stages x 2 data-parallel replicas
// with DDP over new_group subgroups). Each rank of programs/pipeline_worker compares its stage
// with the unsplit model trained on the global batch for 10 steps (within 1e-5).

#include "test_util.h"

#include <gtest/gtest.h>

namespace paratrain {
namespace testing {
namespace {

struct PipeCase {
  std::string name;
  std::string backend;
  int ranks;
  std::vector<std::string> args;
};

void PrintTo(const PipeCase& c, std::ostream* os) {
  *os << c.name << " on " << c.ranks << " " << c.backend << " ranks";
}

class PipelineDistributed : public ::testing::TestWithParam<PipeCase> {};

TEST_P(PipelineDistributed, MatchesSingleProcess) {
  const PipeCase c = GetParam();
  expect_every_rank_ok(PARATRAIN_TEST_PIPELINE_WORKER, c.backend, c.ranks, c.args);
}

std::vector<PipeCase> pipeline_cases() {
  std::vector<PipeCase> out{
      {"gpipe_2_stages", "gloo", 2, {"--stages", "2", "--schedule", "gpipe", "--chunks", "4"}},
      {"1f1b_2_stages", "gloo", 2, {"--stages", "2", "--schedule", "1f1b", "--chunks", "4"}},
      {"1f1b_3_stages",
       "gloo",
       3,
       {"--stages", "3", "--schedule", "1f1b", "--chunks", "5", "--batch", "10"}},
      {"gpipe_3_stages_recompute",
       "gloo",
       3,
       {"--stages", "3", "--schedule", "gpipe", "--chunks", "4", "--checkpoint"}},
      {"2d_1f1b_2x2", "gloo", 4, {"--stages", "2", "--schedule", "1f1b", "--chunks", "4"}},
  };
#ifdef PARATRAIN_WITH_MPI
  std::vector<PipeCase> mpi{
      {"gpipe_3_stages", "mpi", 3, {"--stages", "3", "--schedule", "gpipe", "--chunks", "4"}},
      {"1f1b_2_stages_recompute",
       "mpi",
       2,
       {"--stages", "2", "--schedule", "1f1b", "--chunks", "4", "--checkpoint"}},
      {"2d_gpipe_2x2", "mpi", 4, {"--stages", "2", "--schedule", "gpipe", "--chunks", "2"}},
  };
  out.insert(out.end(), mpi.begin(), mpi.end());
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases,
                         PipelineDistributed,
                         ::testing::ValuesIn(pipeline_cases()),
                         [](const ::testing::TestParamInfo<PipeCase>& info) {
                           return info.param.name + "_" + info.param.backend;
                         });

}  // namespace
}  // namespace testing
}  // namespace paratrain
