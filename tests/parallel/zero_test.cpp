// ZeroRedundancyOptimizer against the unsharded optimizer, with real ranks on loopback: each case
// runs programs/zero_worker (see its header for what every rank checks), plus a state saved by
// three ranks and resumed by two, and the parameter sets that cannot be sharded.

#include "test_util.h"

#include <paratrain/comm/init.h>
#include <paratrain/parallel/zero_redundancy_optimizer.h>

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cstdio>

namespace paratrain {
namespace testing {
namespace {

struct ZeroCase {
  std::string name;
  std::string backend;
  int ranks;
  std::vector<std::string> args;
};

void PrintTo(const ZeroCase& c, std::ostream* os) {
  *os << c.name << " on " << c.ranks << " " << c.backend << " ranks";
}

class ZeroEquivalence : public ::testing::TestWithParam<ZeroCase> {};

TEST_P(ZeroEquivalence, MatchesUnshardedOptimizer) {
  const ZeroCase& c = GetParam();
  expect_every_rank_ok(PARATRAIN_TEST_ZERO_WORKER, c.backend, c.ranks, c.args);
}

std::vector<ZeroCase> zero_cases() {
  std::vector<ZeroCase> out{
      {"sgd_momentum", "gloo", 2, {"--optimizer", "sgd"}},
      {"sgd_two_groups", "gloo", 3, {"--optimizer", "sgd", "--groups", "2"}},
      {"adam", "gloo", 2, {"--optimizer", "adam"}},
      {"adam", "gloo", 3, {"--optimizer", "adam", "--groups", "2"}},
  };
#ifdef PARATRAIN_WITH_MPI
  out.push_back({"adam", "mpi", 2, {"--optimizer", "adam"}});
  out.push_back({"sgd_momentum", "mpi", 3, {"--optimizer", "sgd"}});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases,
                         ZeroEquivalence,
                         ::testing::ValuesIn(zero_cases()),
                         [](const ::testing::TestParamInfo<ZeroCase>& info) {
                           return info.param.name + "_" + info.param.backend + "_" +
                                  std::to_string(info.param.ranks) + "ranks";
                         });

TEST(Zero, StateSavedByThreeRanksResumesOnTwo) {
  const std::string file = "/tmp/" + unique_token("paratrain-zero") + ".safetensors";
  expect_every_rank_ok(PARATRAIN_TEST_ZERO_WORKER, "gloo", 3,
                       {"--optimizer", "adam", "--save", file});
  expect_every_rank_ok(PARATRAIN_TEST_ZERO_WORKER, "gloo", 2,
                       {"--optimizer", "adam", "--load", file, "--steps", "3"});
  std::remove(file.c_str());
}

dist::ProcessGroupPtr world_of_one() {
  const std::string path = "/tmp/" + unique_token("paratrain-zero-store");
  return dist::init_process_group(
      dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
}

ZeroRedundancyOptimizer::OptimizerFactory sgd() {
  return [](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.1));
  };
}

TEST(Zero, WorldOfOneIsThePlainOptimizer) {
  auto pg = world_of_one();
  torch::manual_seed(0);
  auto w = torch::randn({4, 3}, torch::requires_grad());
  auto v = w.detach().clone().requires_grad_(true);
  ZeroRedundancyOptimizer zero({w}, sgd(), pg);
  torch::optim::SGD plain({v}, torch::optim::SGDOptions(0.1));
  for (int i = 0; i < 3; ++i) {
    auto x = torch::randn({3});
    zero.zero_grad();
    plain.zero_grad();
    w.matmul(x).pow(2).sum().backward();
    v.matmul(x).pow(2).sum().backward();
    zero.step();
    plain.step();
  }
  EXPECT_TRUE(torch::equal(w, v));
  // A schedule changes param_groups()' options; the step uses them.
  static_cast<torch::optim::SGDOptions&>(zero.param_groups()[0].options()).lr(0);
  auto before = w.detach().clone();
  zero.zero_grad();
  w.sum().backward();
  zero.step();
  EXPECT_TRUE(torch::equal(w, before));
}

TEST(Zero, RefusesWhatCannotBeSharded) {
  auto pg = world_of_one();
  auto a = torch::zeros({2}, torch::requires_grad());
  auto d = torch::zeros({2}, torch::dtype(torch::kDouble).requires_grad(true));
  EXPECT_NE(error_of([&] {
              ZeroRedundancyOptimizer({a, d}, sgd(), pg);
            }).find("parameter 1 of group 0 is Double on cpu and the first is Float on cpu"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ZeroRedundancyOptimizer({a, a}, sgd(), pg);
            }).find("listed twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ZeroRedundancyOptimizer(std::vector<torch::Tensor>{}, sgd(), pg);
            }).find("no parameters to shard"),
            std::string::npos);
  auto sparse = torch::zeros({2, 2}).to_sparse();
  EXPECT_NE(error_of([&] { ZeroRedundancyOptimizer({sparse}, sgd(), pg); }).find("is sparse"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { ZeroRedundancyOptimizer({a}, sgd(), nullptr); }).find("process group is null"),
      std::string::npos);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
