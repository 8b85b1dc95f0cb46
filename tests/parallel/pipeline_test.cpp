// Pipelines in one process (a thread per stage, CPU stages standing in for devices) against the
// unsplit model; schedules; balancing; bad input. Multi-process pipelines: pipeline_dist_test.cpp.

#include "test_util.h"

#include "paratrain/parallel/pipeline.h"

#include "paratrain/models/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace paratrain {
namespace pipeline {
namespace {

namespace nn = torch::nn;

nn::Sequential deep_net(bool batchnorm = false) {
  torch::manual_seed(0);
  nn::Sequential net;
  net->push_back("fc0", nn::Linear(10, 32));
  if (batchnorm) {
    net->push_back("bn0", nn::BatchNorm1d(32));
  }
  net->push_back("relu0", nn::ReLU());
  net->push_back("fc1", nn::Linear(32, 32));
  net->push_back("tanh1", nn::Tanh());
  net->push_back("fc2", nn::Linear(32, 16));
  net->push_back("relu2", nn::ReLU());
  net->push_back("fc3", nn::Linear(16, 4));
  return net;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

std::vector<torch::Device> cpus(size_t n) {
  return std::vector<torch::Device>(n, torch::Device(torch::kCPU));
}

// expect_close allows 1e-5: Micro-batch sums differ from one batch's sums in float rounding only.
using paratrain::testing::expect_close;

void expect_same_grads(const nn::Sequential& a, const nn::Sequential& b, const std::string& what) {
  auto pb = b->named_parameters();
  for (const auto& p : a->named_parameters()) {
    expect_close(p.value().grad(), pb[p.key()].grad(), what + ": gradient of " + p.key());
  }
}

TEST(PipelineSchedule, GPipeAndOneFOneBOrders) {
  using K = Action::Kind;
  auto g = actions(Schedule::kGPipe, 0, 2, 3);
  std::vector<Action> gpipe{{K::kForward, 0},  {K::kForward, 1},  {K::kForward, 2},
                            {K::kBackward, 0}, {K::kBackward, 1}, {K::kBackward, 2}};
  EXPECT_EQ(g, gpipe);
  // Stage 0 of 2: one warm-up forward, then F/B pairs, then the last backward.
  std::vector<Action> s0{{K::kForward, 0},  {K::kForward, 1}, {K::kBackward, 0}, {K::kForward, 2},
                         {K::kBackward, 1}, {K::kForward, 3}, {K::kBackward, 2}, {K::kBackward, 3}};
  EXPECT_EQ(actions(Schedule::k1F1B, 0, 2, 4), s0);
  std::vector<Action> s1{{K::kForward, 0},  {K::kBackward, 0}, {K::kForward, 1},
                         {K::kBackward, 1}, {K::kForward, 2},  {K::kBackward, 2}};
  EXPECT_EQ(actions(Schedule::k1F1B, 1, 2, 3), s1);
  EXPECT_EQ(parse_schedule("1F1B"), Schedule::k1F1B);
  EXPECT_THROW(parse_schedule("zero-bubble"), c10::Error);
}

TEST(PipelineBalance, PartitionMinimisesTheLargestStage) {
  EXPECT_EQ(partition({1, 1, 1, 100}, 2), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(partition({5, 5, 5, 5}, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(partition({1, 2, 3, 4, 5, 6}, 3), (std::vector<int64_t>{3, 2, 1}));
  auto net = deep_net();
  // fc0 330, fc1 1056, fc2 528, fc3 68 parameters (+ 0 for activations).
  // fc1 decides (1386 either way); ties put the cut later.
  EXPECT_EQ(balance_by_parameters(net, 2), (std::vector<int64_t>{4, 3}));
  auto by_time = balance_by_time(net, 2, torch::randn({8, 10}));
  ASSERT_EQ(by_time.size(), 2u);
  EXPECT_EQ(by_time[0] + by_time[1], 7);
  for (const auto& p : net->parameters()) {
    EXPECT_FALSE(p.grad().defined()) << "balance_by_time left gradients behind";
  }
}

TEST(PipelineBalance, FlattenCutsBetweenBlocks) {
  torch::manual_seed(3);
  auto resnet = models::make("resnet18_cifar");
  auto flat = flatten(resnet);
  // conv1, bn1, relu, 4 layers x 2 blocks, avgpool, flatten, fc.
  EXPECT_EQ(flat->size(), 3u + 8u + 3u);
  EXPECT_EQ(flat->named_children()[3].key(), "layer1_0");
  EXPECT_EQ(flat->parameters().size(), resnet->parameters().size());
  resnet->eval();
  torch::NoGradGuard no_grad;
  auto x = torch::randn({2, 3, 32, 32});
  expect_close(flat->forward(x), resnet->forward(x), "flattened forward");
}

struct Case {
  Schedule schedule;
  std::vector<int64_t> balance;
  int64_t chunks;
  int64_t batch;
  bool checkpoint;
};

void check_case(const Case& c) {
  SCOPED_TRACE(to_string(c.schedule) + ", " + std::to_string(c.balance.size()) + " stages, " +
               std::to_string(c.chunks) + " chunks, batch " + std::to_string(c.batch) +
               (c.checkpoint ? ", checkpoint" : ""));
  auto plain = deep_net();
  auto piped = deep_net();
  torch::manual_seed(7);
  auto x = torch::randn({c.batch, 10});
  auto y = torch::randint(0, 4, {c.batch});
  auto want = ce(plain->forward(x), y);
  want.backward();
  Pipeline pipe(piped, c.balance, cpus(c.balance.size()), ce,
                PipelineOptions().chunks(c.chunks).schedule(c.schedule).checkpoint(c.checkpoint));
  auto loss = pipe.step(x, y);
  expect_close(loss, want, "loss");
  expect_same_grads(plain, piped, "after one step");
}

TEST(Pipeline, GradientsEqualUnsplitModel) {
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B}) {
    check_case({s, {4, 3}, 1, 8, false});        // plain model parallelism
    check_case({s, {4, 3}, 4, 8, false});        // 2 stages
    check_case({s, {2, 3, 2}, 4, 12, false});    // 3 stages
    check_case({s, {2, 3, 2}, 4, 10, false});    // uneven micro-batches: 3, 3, 2, 2
    check_case({s, {1, 1, 1, 4}, 8, 8, false});  // micro-batches of one sample
    check_case({s, {2, 3, 2}, 4, 12, true});     // recomputation
  }
}

TEST(Pipeline, TrainingMatchesUnsplitModel) {
  auto plain = deep_net();
  auto piped = deep_net();
  Pipeline pipe(piped, {3, 4}, cpus(2), ce, PipelineOptions().chunks(4).schedule(Schedule::k1F1B));
  torch::optim::SGD o1(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD o2(piped->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(8);
  for (int step = 0; step < 10; ++step) {
    auto x = torch::randn({8, 10});
    auto y = torch::randint(0, 4, {8});
    o1.zero_grad();
    ce(plain->forward(x), y).backward();
    o1.step();
    o2.zero_grad();
    pipe.step(x, y);
    o2.step();
  }
  auto p2 = piped->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    expect_close(p.value(), p2[p.key()], "parameter " + p.key() + " after 10 steps");
  }
  // Evaluation: micro-batched forward without a graph equals the model's forward.
  torch::NoGradGuard no_grad;
  auto x = torch::randn({6, 10});
  auto out = pipe.forward(x);
  EXPECT_FALSE(out.requires_grad());
  expect_close(out, plain->forward(x), "forward");
}

// BatchNorm sees micro-batches: gradients are those of the unsplit model run on each micro-batch
// (loss weighted by its share), and running statistics are updated once per micro-batch, in
// order.
TEST(Pipeline, BatchNormMicroBatchSemantics) {
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B}) {
    auto plain = deep_net(/*batchnorm=*/true);
    auto piped = deep_net(/*batchnorm=*/true);
    torch::manual_seed(9);
    auto x = torch::randn({12, 10});
    auto y = torch::randint(0, 4, {12});
    auto xs = torch::tensor_split(x, 3);
    auto ys = torch::tensor_split(y, 3);
    for (size_t i = 0; i < 3; ++i) {
      (ce(plain->forward(xs[i]), ys[i]) * (xs[i].size(0) / 12.0)).backward();
    }
    Pipeline pipe(piped, {4, 4}, cpus(2), ce, PipelineOptions().chunks(3).schedule(s));
    pipe.step(x, y);
    expect_same_grads(plain, piped, "batchnorm " + to_string(s));
    auto b2 = piped->named_buffers();
    for (const auto& b : plain->named_buffers()) {
      expect_close(b.value().to(torch::kDouble), b2[b.key()].to(torch::kDouble),
                   "buffer " + b.key());
    }
  }
}

// 1F1B bounds the activations alive on stage s by p - s; GPipe holds all m.
TEST(Pipeline, OneFOneBKeepsAtMostStagesMicroBatchesAlive) {
  const int64_t m = 8;
  auto net = deep_net();
  auto x = torch::randn({16, 10});
  auto y = torch::randint(0, 4, {16});
  Pipeline onef(net, {2, 2, 3}, cpus(3), ce, PipelineOptions().chunks(m).schedule(Schedule::k1F1B));
  onef.step(x, y);
  auto stats = onef.last_stats();
  ASSERT_EQ(stats.size(), 3u);
  for (int64_t s = 0; s < 3; ++s) {
    EXPECT_LE(stats[static_cast<size_t>(s)].max_live_micro_batches, 3 - s) << "stage " << s;
    EXPECT_GE(stats[static_cast<size_t>(s)].max_live_micro_batches, 1) << "stage " << s;
  }
  Pipeline gpipe(net, {2, 2, 3}, cpus(3), ce, PipelineOptions().chunks(m));
  gpipe.step(x, y);
  for (const auto& st : gpipe.last_stats()) {
    EXPECT_EQ(st.max_live_micro_batches, m);
  }
}

struct FailsImpl : nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(false, "this layer always fails (", x.size(0), " samples)");
  }
};
TORCH_MODULE(Fails);

TEST(Pipeline, FailingStageIsNamedAndOthersStop) {
  nn::Sequential net;
  net->push_back("fc0", nn::Linear(4, 4));
  net->push_back("boom", Fails());
  net->push_back("fc1", nn::Linear(4, 2));
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B}) {
    Pipeline pipe(net, {1, 1, 1}, cpus(3), ce, PipelineOptions().chunks(2).schedule(s));
    try {
      pipe.step(torch::randn({4, 4}), torch::zeros({4}, torch::kLong));
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("pipeline: stage 1 on cpu failed: this layer always fails (2 samples)"),
                std::string::npos)
          << what;
    }
  }
}

using paratrain::testing::error_of;

TEST(Pipeline, BadInput) {
  auto net = deep_net();  // 7 layers
  // A GPU past the last one (cuda:0 on a machine without CUDA).
  const torch::Device missing_gpu(torch::kCUDA,
                                  static_cast<c10::DeviceIndex>(torch::cuda::device_count()));
  auto x = torch::randn({4, 10});
  auto y = torch::zeros({4}, torch::kLong);
  auto has = [](const std::string& what, const std::string& part) {
    EXPECT_NE(what.find(part), std::string::npos) << "expected '" << part << "' in: " << what;
  };
  has(error_of([&] {
        split(net, {3, 3});
      }),
      "the balance [3, 3] sums to 6 layers but the model has 7");
  has(error_of([&] { split(net, {3, 0, 4}); }), "stage 1 of the balance has 0 layers");
  has(error_of([&] { split(net, std::vector<int64_t>(8, 1)); }),
      "8 stages but the model has only 7 layers");
  has(error_of([&] { balance_by_parameters(net, 9); }), "9 stages but the model has only 7 layers");
  has(error_of([&] { Pipeline(net, {3, 4}, {}, ce); }), "the device list is empty");
  has(error_of([&] { Pipeline(net, {3, 4}, cpus(3), ce); }), "2 stages but 3 devices");
  has(error_of([&] {
        Pipeline(net, {3, 4}, {missing_gpu, torch::kCPU}, ce);
      }),
      missing_gpu.str() + " does not exist");
  has(error_of([&] {
        Pipeline(net, {3, 4}, cpus(2), ce, PipelineOptions().chunks(0));
      }),
      "chunks must be >= 1, got 0");
  Pipeline pipe(net, {3, 4}, cpus(2), ce, PipelineOptions().chunks(8));
  has(error_of([&] { pipe.step(x, y); }), "chunks (8) is larger than the batch (4 samples");
  has(error_of([&] { as_sequential(std::make_shared<nn::LinearImpl>(2, 2)); }),
      "a pipeline needs a torch::nn::Sequential, got torch::nn::LinearImpl; write the model as a "
      "Sequential");
}

}  // namespace
}  // namespace pipeline
}  // namespace paratrain
