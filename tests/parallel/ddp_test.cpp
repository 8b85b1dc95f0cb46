// DistributedDataParallel against single-process training, with real processes on loopback: each
// case runs programs/ddp_worker on N ranks, where every rank compares its DDP-trained parameters
// after 10 SGD-with-momentum steps with a reference trained on the whole batch (see the worker's
// header for why they must agree, within 1e-5).

#include "test_util.h"

#include <gtest/gtest.h>

namespace paratrain {
namespace testing {
namespace {

struct DdpCase {
  std::string name;
  std::string backend;
  int ranks;
  std::vector<std::string> args;
};

void PrintTo(const DdpCase& c, std::ostream* os) {
  *os << c.name << " on " << c.ranks << " " << c.backend << " ranks";
}

class DdpEquivalence : public ::testing::TestWithParam<DdpCase> {};

TEST_P(DdpEquivalence, MatchesSingleProcess) {
  const DdpCase c = GetParam();
  expect_every_rank_ok(PARATRAIN_TEST_DDP_WORKER, c.backend, c.ranks, c.args);
}

std::vector<DdpCase> ddp_cases() {
  const std::vector<std::string> many_buckets{"--bucket-cap-mb", "0.0001", "--first-bucket-mb",
                                              "0.0001"};
  std::vector<DdpCase> out{
      {"plain", "gloo", 2, {}},
      {"plain", "gloo", 3, {}},
      {"many_buckets", "gloo", 3, many_buckets},
      {"bucket_view", "gloo", 2, {"--view"}},
      {"bucket_view_no_sync", "gloo", 3, {"--view", "--zero-in-place", "--micro-steps", "4"}},
      {"unused_parameter", "gloo", 2, {"--unused"}},
      {"no_sync_4_micro_steps", "gloo", 3, {"--micro-steps", "4"}},
      {"unused_in_synced_micro_step", "gloo", 2, {"--unused", "--sometimes", "--micro-steps", "4"}},
      {"allreduce_hook", "gloo", 3, {"--hook", "allreduce"}},
      {"fp16_compression", "gloo", 2, {"--hook", "fp16"}},
      {"bf16_compression", "gloo", 2, {"--hook", "bf16"}},
      {"batchnorm_broadcast_buffers", "gloo", 2, {"--bn"}},
      {"batchnorm_local_buffers", "gloo", 2, {"--bn", "--no-broadcast-buffers"}},
  };
#ifdef PARATRAIN_WITH_MPI
  std::vector<DdpCase> mpi{
      {"plain", "mpi", 2, {}},
      {"plain", "mpi", 3, {}},
      {"many_buckets", "mpi", 2, many_buckets},
      {"view_no_sync_many_buckets",
       "mpi",
       3,
       {"--view", "--micro-steps", "4", "--bucket-cap-mb", "0.0001", "--first-bucket-mb",
        "0.0001"}},
      {"unused_parameter", "mpi", 3, {"--unused"}},
      {"no_sync_4_micro_steps", "mpi", 2, {"--micro-steps", "4"}},
      {"fp16_compression", "mpi", 2, {"--hook", "fp16"}},
      {"bf16_compression", "mpi", 2, {"--hook", "bf16"}},
      {"batchnorm_broadcast_buffers", "mpi", 3, {"--bn"}},
  };
  out.insert(out.end(), mpi.begin(), mpi.end());
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases,
                         DdpEquivalence,
                         ::testing::ValuesIn(ddp_cases()),
                         [](const ::testing::TestParamInfo<DdpCase>& info) {
                           return info.param.name + "_" + info.param.backend + "_" +
                                  std::to_string(info.param.ranks) + "ranks";
                         });

TEST(Ddp, WorldOfOneIsPlainTraining) {
  auto r = run_process({PARATRAIN_TEST_DDP_WORKER}, world_of_one_env(), 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0: ok"), std::string::npos) << r.output;
}

TEST(Ddp, UnusedParameterWithoutDetectionNamesIt) {
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                        PARATRAIN_TEST_DDP_WORKER, "--expect-unused-error"},
                       {{"PARATRAIN_TIMEOUT", "60"}}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: DistributedDataParallel: expected to have finished reduction in "
                          "the prior iteration before starting a new one: parameters that "
                          "received no gradient: spare.weight, spare.bias. Your module has "
                          "parameters that were not used in producing the loss; enable unused "
                          "parameter detection with DDPOptions().find_unused_parameters(true)"),
            std::string::npos)
      << r.output;
}

TEST(Ddp, DifferentParametersAcrossRanksNameTheFirstDifference) {
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                        PARATRAIN_TEST_DDP_WORKER, "--mismatch"},
                       {{"PARATRAIN_TIMEOUT", "60"}}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: DistributedDataParallel: rank 1's parameters differ from rank "
                          "0's at parameter #0: rank 0 has 'fc1.weight' Float [64, 20], rank 1 has "
                          "'fc1.weight' Float [64, 21]; every rank must build the same model"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
