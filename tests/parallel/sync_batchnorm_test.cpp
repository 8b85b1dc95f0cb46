// SyncBatchNorm against BatchNorm over the whole batch in one process: real ranks on loopback run
// programs/syncbn_worker (see its header for what each rank checks, within 1e-5), plus the
// conversion itself and the world-of-one fallback in this process.

#include "test_util.h"

#include <paratrain/models/registry.h>
#include <paratrain/parallel/sync_batchnorm.h>

#include <torch/torch.h>

#include <gtest/gtest.h>

namespace paratrain {
namespace testing {
namespace {

struct SyncBnCase {
  std::string name;
  std::string backend;
  int ranks;
  std::vector<std::string> args;
};

void PrintTo(const SyncBnCase& c, std::ostream* os) {
  *os << c.name << " on " << c.ranks << " " << c.backend << " ranks";
}

class SyncBatchNormEquivalence : public ::testing::TestWithParam<SyncBnCase> {};

TEST_P(SyncBatchNormEquivalence, MatchesWholeBatch) {
  const SyncBnCase& c = GetParam();
  expect_every_rank_ok(PARATRAIN_TEST_SYNCBN_WORKER, c.backend, c.ranks, c.args);
}

std::vector<SyncBnCase> sync_bn_cases() {
  std::vector<SyncBnCase> out{
      {"bn1d_even", "gloo", 2, {"--dim", "1"}},
      {"bn1d_uneven", "gloo", 3, {"--dim", "1", "--rows", "2", "--skew", "3"}},
      {"bn2d_uneven", "gloo", 2, {"--dim", "2", "--rows", "5", "--skew", "-3"}},
      {"bn2d_empty_rank", "gloo", 3, {"--dim", "2", "--rows", "4", "--skew", "-2"}},
      {"ddp", "gloo", 3, {"--mode", "ddp", "--steps", "5"}},
  };
#ifdef PARATRAIN_WITH_MPI
  out.push_back({"bn2d_uneven", "mpi", 3, {"--dim", "2", "--rows", "1", "--skew", "2"}});
  out.push_back({"ddp", "mpi", 2, {"--mode", "ddp", "--steps", "5"}});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases,
                         SyncBatchNormEquivalence,
                         ::testing::ValuesIn(sync_bn_cases()),
                         [](const ::testing::TestParamInfo<SyncBnCase>& info) {
                           return info.param.name + "_" + info.param.backend + "_" +
                                  std::to_string(info.param.ranks) + "ranks";
                         });

TEST(SyncBatchNorm, WorldOfOneRunsTheWorker) {
  auto r = run_process({PARATRAIN_TEST_SYNCBN_WORKER, "--dim", "2", "--rows", "5"},
                       world_of_one_env(), 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0: ok"), std::string::npos) << r.output;
}

TEST(SyncBatchNorm, WithoutAGroupItIsBatchNorm) {
  torch::manual_seed(0);
  torch::nn::BatchNorm2d bn(torch::nn::BatchNorm2dOptions(4).momentum(c10::nullopt));
  SyncBatchNorm sync(SyncBatchNormOptions(4).momentum(std::nullopt));
  for (int i = 0; i < 3; ++i) {
    auto x = torch::randn({5, 4, 3, 3});
    EXPECT_TRUE(torch::equal(bn(x), sync(x)));
  }
  EXPECT_TRUE(torch::equal(bn->running_mean, sync->running_mean));
  EXPECT_TRUE(torch::equal(bn->running_var, sync->running_var));
  EXPECT_EQ(sync->num_batches_tracked.item<int64_t>(), 3);
}

TEST(SyncBatchNorm, BadInputIsNamed) {
  SyncBatchNorm sync(3);
  EXPECT_NE(error_of([&] {
              sync(torch::randn({4, 5}));
            }).find("expected 3 channels"),
            std::string::npos);
  EXPECT_NE(error_of([&] { sync(torch::randn({4})); }).find("at least 2-D"), std::string::npos);
  EXPECT_NE(error_of([] { SyncBatchNorm bad(0); }).find("num_features must be positive"),
            std::string::npos);
}

TEST(ConvertSyncBatchNorm, ResNetKeepsItsTensorsAndNames) {
  auto model = models::make("resnet18_cifar", 10);
  model->named_parameters()["layer1.0.bn1.weight"].set_requires_grad(false);  // frozen stays so
  auto before = model->named_parameters();
  auto buffers_before = model->named_buffers();
  EXPECT_EQ(convert_sync_batchnorm(model.ptr(), nullptr), 20);  // stem, 16 in blocks, 3 shortcuts
  auto after = model->named_parameters();
  ASSERT_EQ(before.keys(), after.keys());
  for (const auto& p : before) {
    EXPECT_TRUE(p.value().is_same(after[p.key()])) << p.key();
    EXPECT_EQ(after[p.key()].requires_grad(), p.key() != "layer1.0.bn1.weight") << p.key();
  }
  // A converted model clones (DataParallel replicas): the blocks rebuild SyncBatchNorm slots.
  // (Sequential's clone numbers its children: count the copies instead of naming them.)
  auto copy = model->clone();
  int64_t copied = 0;
  for (const auto& m : copy->modules()) {
    copied += m->as<SyncBatchNorm>() != nullptr;
  }
  EXPECT_EQ(copied, 20);
  ASSERT_EQ(buffers_before.keys(), model->named_buffers().keys());
  int64_t syncs = 0;
  for (const auto& m : model->modules()) {
    syncs += m->as<SyncBatchNorm>() != nullptr;
    EXPECT_FALSE(m->as<torch::nn::BatchNorm2d>()) << m->name();
  }
  EXPECT_EQ(syncs, 20);
  // The blocks' forwards call the replacements: running statistics move through them.
  auto sync = model->named_modules()["layer1.0.bn1"]->as<SyncBatchNorm>();
  ASSERT_NE(sync, nullptr);
  model->forward(torch::randn({2, 3, 32, 32}));
  EXPECT_EQ(sync->num_batches_tracked.item<int64_t>(), 1);
  EXPECT_EQ(model->named_buffers()["layer1.0.bn1.num_batches_tracked"].item<int64_t>(), 1);
}

struct MemberBn : torch::nn::Module {
  MemberBn() { bn = register_module("bn", torch::nn::BatchNorm1d(3)); }
  torch::Tensor forward(const torch::Tensor& x) { return bn(x); }
  torch::nn::BatchNorm1d bn{nullptr};
};

TEST(ConvertSyncBatchNorm, RefusesWhatItCannotRebind) {
  auto outer = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3));
  outer->push_back("custom", std::make_shared<MemberBn>());
  std::string e = error_of([&] { convert_sync_batchnorm(outer.ptr(), nullptr); });
  EXPECT_NE(e.find("cannot replace 'custom.bn'"), std::string::npos) << e;
  // Nothing was converted before the error.
  EXPECT_NE(outer[1]->as<torch::nn::BatchNorm1d>(), nullptr);
  auto bn = torch::nn::BatchNorm1d(3);
  EXPECT_NE(error_of([&] { convert_sync_batchnorm(bn.ptr(), nullptr); }).find("itself a BatchNorm"),
            std::string::npos);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
