// DataParallel against the plain module, in one process with several CPU replicas (each on its
// own thread, standing in for several GPUs).

#include "test_util.h"

#include "paratrain/amp/autocast.h"
#include "paratrain/models/registry.h"
#include "paratrain/parallel/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace paratrain {
namespace {

namespace nn = torch::nn;

nn::Sequential small_net(bool batchnorm = false) {
  torch::manual_seed(0);
  nn::Sequential net;
  net->push_back("fc0", nn::Linear(12, 16));
  if (batchnorm) {
    net->push_back("bn", nn::BatchNorm1d(16));
  }
  net->push_back("relu", nn::ReLU());
  net->push_back("fc1", nn::Linear(16, 5));
  return net;
}

std::vector<torch::Device> cpus(int n) {
  return std::vector<torch::Device>(static_cast<size_t>(n), torch::Device(torch::kCPU));
}

// expect_close allows 1e-5: Float sums in a different order (per chunk, then across replicas)
// differ in the last bits.
using paratrain::testing::expect_close;

// Output, parameter gradients and input gradient of one forward/backward, plain vs DataParallel.
void check_against_plain(int replicas, int64_t batch) {
  SCOPED_TRACE(std::to_string(replicas) + " replicas, batch " + std::to_string(batch));
  auto plain = small_net();
  auto wrapped = small_net();  // same seed: same weights
  DataParallel dp(wrapped, cpus(replicas));
  torch::manual_seed(1);
  auto x = torch::randn({batch, 12});
  auto y = torch::randint(0, 5, {batch});

  auto x1 = x.clone().requires_grad_(true);
  auto out1 = plain->forward(x1);
  torch::nn::functional::cross_entropy(out1, y).backward();

  auto x2 = x.clone().requires_grad_(true);
  auto out2 = dp(x2);
  torch::nn::functional::cross_entropy(out2, y).backward();

  EXPECT_EQ(dp.last_replicas_used(), static_cast<size_t>(std::min<int64_t>(replicas, batch)));
  expect_close(out1, out2, "output");
  expect_close(x1.grad(), x2.grad(), "input gradient");
  auto p1 = plain->named_parameters();
  auto p2 = wrapped->named_parameters();
  for (const auto& p : p1) {
    expect_close(p.value().grad(), p2[p.key()].grad(), "gradient of " + p.key());
  }
}

TEST(DataParallel, OneReplicaEqualsPlainModule) {
  check_against_plain(1, 8);
}
TEST(DataParallel, TwoReplicasEqualPlainModule) {
  check_against_plain(2, 8);
}
TEST(DataParallel, ThreeReplicasEqualPlainModule) {
  check_against_plain(3, 9);
}
TEST(DataParallel, UnevenBatches) {
  check_against_plain(3, 7);  // chunks 3, 3, 1
  check_against_plain(3, 2);  // fewer samples than devices: two replicas of one sample
  check_against_plain(2, 1);  // one sample: one replica
}

// Ten SGD-with-momentum steps: the wrapped module's parameters follow the plain module's.
TEST(DataParallel, TrainingMatchesSingleDevice) {
  auto plain = small_net();
  auto wrapped = small_net();
  DataParallel dp(wrapped, cpus(2));
  torch::optim::SGD o1(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD o2(wrapped->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(2);
  for (int step = 0; step < 10; ++step) {
    auto x = torch::randn({10, 12});
    auto y = torch::randint(0, 5, {10});
    o1.zero_grad();
    torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
    o1.step();
    o2.zero_grad();
    torch::nn::functional::cross_entropy(dp(x), y).backward();
    o2.step();
  }
  auto p2 = wrapped->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    expect_close(p.value(), p2[p.key()], "parameter " + p.key() + " after 10 steps");
  }
}

// Gradients accumulate across backwards, and two forwards may share one backward (the clones
// are not overwritten while a graph still needs them).
TEST(DataParallel, AccumulatesAndAllowsTwoForwardsPerBackward) {
  auto plain = small_net();
  auto wrapped = small_net();
  DataParallel dp(wrapped, cpus(2));
  torch::manual_seed(3);
  auto a = torch::randn({6, 12});
  auto b = torch::randn({6, 12});
  (plain->forward(a).sum() + plain->forward(b).pow(2).sum()).backward();
  plain->forward(a).sum().backward();
  (dp(a).sum() + dp(b).pow(2).sum()).backward();
  dp(a).sum().backward();
  auto p2 = wrapped->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    expect_close(p.value().grad(), p2[p.key()].grad(), "accumulated gradient of " + p.key());
  }
}

// An output kept alive across optimizer steps (its graph never freed) must not stop the clones
// from getting the new weights: libtorch's optimizers do not bump version counters.
TEST(DataParallel, KeptOutputsDoNotFreezeReplicas) {
  auto plain = small_net();
  auto wrapped = small_net();
  DataParallel dp(wrapped, cpus(2));
  torch::optim::SGD o1(plain->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD o2(wrapped->parameters(), torch::optim::SGDOptions(0.1));
  torch::manual_seed(6);
  std::vector<at::Tensor> kept;
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({8, 12});
    auto y = torch::randint(0, 5, {8});
    o1.zero_grad();
    torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
    o1.step();
    kept.push_back(dp(x));  // a graph that stays alive
    o2.zero_grad();
    torch::nn::functional::cross_entropy(dp(x), y).backward();
    o2.step();
  }
  auto p2 = wrapped->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    expect_close(p.value(), p2[p.key()], "parameter " + p.key() + " after 5 steps");
  }
}

// Under autocast, replica threads must not reuse the bf16 weights they cast in an earlier
// forward: weights change in place between steps.
TEST(DataParallel, AutocastSeesUpdatedWeights) {
  auto plain = small_net();
  auto wrapped = small_net();
  DataParallel dp(wrapped, cpus(2));
  auto x = torch::randn({8, 12});
  for (int step = 0; step < 3; ++step) {
    amp::Autocast autocast(torch::kCPU);
    auto want = plain->forward(x);
    auto got = dp(x);
    EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
    expect_close(got.to(torch::kFloat), want.to(torch::kFloat), "step " + std::to_string(step));
    torch::NoGradGuard no_grad;
    for (auto* m : {&plain, &wrapped}) {
      for (auto& p : (*m)->parameters()) {
        p.add_(0.5);
      }
    }
  }
}

// BatchNorm saves its running statistics for backward: a second training forward before the
// first one's backward must leave the first graph usable.
TEST(DataParallel, BatchNormTwoForwardsOneBackward) {
  auto net = small_net(/*batchnorm=*/true);
  DataParallel dp(net, cpus(2));
  auto a = torch::randn({8, 12});
  auto b = torch::randn({8, 12});
  EXPECT_NO_THROW((dp(a).sum() + dp(b).pow(2).sum()).backward());
  for (const auto& p : net->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>());
  }
}

// As in PyTorch, the running statistics after a training forward are those of the first chunk
// (replica 0 is the module itself), and the clones use the module's buffers at every forward.
TEST(DataParallel, BatchNormBuffersComeFromFirstReplica) {
  auto net = small_net(/*batchnorm=*/true);
  auto first_only = small_net(/*batchnorm=*/true);
  DataParallel dp(net, cpus(2));
  torch::manual_seed(4);
  auto x = torch::randn({8, 12});
  dp(x).sum().backward();
  first_only->forward(x.slice(0, 0, 4));
  auto b1 = net->named_buffers();
  for (const auto& b : first_only->named_buffers()) {
    expect_close(b.value().to(torch::kDouble), b1[b.key()].to(torch::kDouble), "buffer " + b.key());
  }
  // Eval mode: every replica normalises with the module's running statistics.
  net->eval();
  first_only->eval();
  torch::NoGradGuard no_grad;
  auto out = dp(x);
  EXPECT_FALSE(out.requires_grad());
  expect_close(out, first_only->forward(x), "eval output");
}

// The zoo's ResNet (nested Sequentials of custom blocks) clones, and its replicas compute the
// module's gradients.
TEST(DataParallel, ResNetReplicas) {
  torch::manual_seed(5);
  auto plain = models::make("resnet18_cifar");
  torch::manual_seed(5);
  auto wrapped = models::make("resnet18_cifar");
  plain->eval();  // per-chunk batch statistics would differ from whole-batch ones
  wrapped->eval();
  DataParallel dp(wrapped, cpus(2));
  auto x = torch::randn({4, 3, 32, 32});
  auto y = torch::tensor({1, 2, 3, 4});
  torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
  torch::nn::functional::cross_entropy(dp(x), y).backward();
  auto p2 = wrapped->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    expect_close(p.value().grad(), p2[p.key()].grad(), "gradient of " + p.key());
  }
}

struct ThrowsOnMarkerImpl : nn::Cloneable<ThrowsOnMarkerImpl> {
  void reset() override { fc = register_module("fc", nn::Linear(4, 2)); }
  ThrowsOnMarkerImpl() { reset(); }
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(x.max().item<double>() < 100, "marker seen in a batch of ", x.size(0));
    return fc(x);
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(ThrowsOnMarker);

TEST(DataParallel, ReplicaExceptionIsRethrownAfterAllFinish) {
  ThrowsOnMarker net;
  DataParallel dp(net, cpus(3));
  auto x = torch::zeros({6, 4});
  x[3][0] = 1000;  // in the second chunk (rows 2..3)
  try {
    dp(x);
    FAIL() << "no exception";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("replica 1 on cpu failed in forward"), std::string::npos) << what;
    EXPECT_NE(what.find("marker seen in a batch of 2"), std::string::npos) << what;
  }
  // The replica threads are free again.
  auto out = dp(torch::zeros({6, 4}));
  EXPECT_EQ(out.size(0), 6);
}

struct NotCloneableImpl : nn::Module {
  NotCloneableImpl() { fc = register_module("fc", nn::Linear(4, 2)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(NotCloneable);

using paratrain::testing::error_of;

TEST(DataParallel, BadInputs) {
  auto net = small_net();
  EXPECT_NE(error_of([&] { DataParallel(net, {}); }).find("device list is empty"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DataParallel(net, {torch::Device("cpu:1")}); }).find("does not exist"),
            std::string::npos);
  if (!torch::cuda::is_available()) {
    EXPECT_NE(error_of([&] {
                DataParallel(net, {torch::Device("cuda:0")});
              }).find("cuda:0 does not exist"),
              std::string::npos);
  }
  NotCloneable nc;
  EXPECT_NE(error_of([&] { DataParallel(nc, cpus(2)); }).find("torch::nn::Cloneable"),
            std::string::npos);
  DataParallel dp(net, cpus(2));
  EXPECT_NE(error_of([&] { dp(torch::zeros({0, 12})); }).find("no samples"), std::string::npos);
  DataParallel dp3(net, cpus(2), DataParallelOptions().dim(3));
  EXPECT_NE(error_of([&] { dp3(torch::zeros({4, 12})); }).find("along dim 3"), std::string::npos);
}

}  // namespace
}  // namespace paratrain
