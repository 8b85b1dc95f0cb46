// The CUDA paths: nccl with one rank, the device-routed group with CPU and CUDA tensors in one job,
// the fused GradScaler kernels with injected infs, fp16 at O1-O3, DataParallel and pipelines on
// CUDA devices, the wire a DistributedPipeline picks from its group, batches prefetched to the
// GPU, FSDP over nccl, and FSDP with its optimizer offloaded to the host. Each test skips, saying
// so, without a GPU.

#include "test_util.h"

#include "paratrain/amp/grad_scaler.h"
#include "paratrain/amp/mixed_precision.h"
#include "paratrain/comm/init.h"
#include "paratrain/data/device_prefetcher.h"
#include "paratrain/data/fashion_mnist.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/registry.h"
#include "paratrain/optim/fused.h"
#include "paratrain/optim/offload.h"
#include "paratrain/parallel/data_parallel.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "paratrain/parallel/pipeline.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace paratrain {
namespace {

using testing::error_of;
using testing::expect_close;
using testing::has_cuda;
using testing::unique_token;

#define SKIP_WITHOUT_CUDA()                                               \
  if (!has_cuda()) {                                                      \
    GTEST_SKIP() << "no CUDA device (this test runs the CUDA code path)"; \
  }

// A test of the nccl backend: skipped, saying why, without a GPU or without nccl in the build.
#ifdef PARATRAIN_WITH_NCCL
#define SKIP_WITHOUT_NCCL() SKIP_WITHOUT_CUDA()
#else
#define SKIP_WITHOUT_NCCL() GTEST_SKIP() << "this build has no nccl (its libtorch has no CUDA)"
#endif

const torch::Device kCuda0(torch::kCUDA, 0);

[[maybe_unused]] dist::ProcessGroupPtr world_of_one(const std::string& backend) {
  return dist::init_process_group(dist::InitOptions()
                                      .backend(backend)
                                      .init_method("file:///tmp/" + unique_token("gpu-store"))
                                      .rank(0)
                                      .world_size(1));
}

TEST(Gpu, NcclWithOneRank) {
  SKIP_WITHOUT_CUDA();
#ifndef PARATRAIN_WITH_NCCL
  GTEST_SKIP() << "this build has no nccl (its libtorch has no CUDA)";
#else
  auto pg = world_of_one("nccl");
  EXPECT_EQ(pg->backend_name(), "nccl");
  auto t = torch::arange(6, torch::TensorOptions(torch::kFloat).device(kCuda0));
  pg->allreduce(t)->wait();
  EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(6, torch::kFloat)));
  pg->barrier()->wait();
  // nccl asked for CPU tensors: one line saying what to use instead.
  auto cpu = torch::ones({2});
  const std::string why = error_of([&] { pg->allreduce(cpu); });
  EXPECT_NE(why.find("nccl allreduce: the tensor is on cpu, but nccl moves CUDA tensors only"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("cpu:gloo,cuda:nccl"), std::string::npos) << why;
#endif
}

TEST(Gpu, RoutedGroupMovesCpuAndCudaTensorsInOneJob) {
  SKIP_WITHOUT_CUDA();
#if !defined(PARATRAIN_WITH_NCCL) || !defined(PARATRAIN_WITH_GLOO)
  GTEST_SKIP() << "this build lacks nccl or gloo";
#else
  EXPECT_EQ(dist::resolve_backend(dist::InitOptions().uses_cuda(true)), "cpu:gloo,cuda:nccl");
  auto pg = world_of_one("cpu:gloo,cuda:nccl");
  EXPECT_EQ(pg->backend_name(), "cpu:gloo,cuda:nccl");
  EXPECT_EQ(pg->backend_for(c10::DeviceType::CPU), "gloo");
  EXPECT_EQ(pg->backend_for(c10::DeviceType::CUDA), "nccl");
  auto c = torch::full({3}, 2.0);
  auto g = torch::full({3}, 5.0, torch::TensorOptions().device(kCuda0));
  auto wc = pg->allreduce(c, dist::ReduceOp::kAvg);
  auto wg = pg->allreduce(g, dist::ReduceOp::kMax);
  wc->wait();
  wg->wait();
  EXPECT_TRUE(torch::equal(c, torch::full({3}, 2.0)));
  EXPECT_TRUE(torch::equal(g.cpu(), torch::full({3}, 5.0)));
  pg->broadcast(g, 0)->wait();
  pg->barrier()->wait();
  // A route for the CPU only: CUDA tensors are refused by name.
  auto cpu_only = world_of_one("cpu:gloo");
  const std::string why = error_of([&] { cpu_only->allreduce(g); });
  EXPECT_NE(why.find("no backend for cuda tensors"), std::string::npos) << why;
#endif
}

TEST(Gpu, RoutedJobOfTwoRanksOnCpuTensors) {
  SKIP_WITHOUT_CUDA();
#if !defined(PARATRAIN_WITH_NCCL) || !defined(PARATRAIN_WITH_GLOO)
  GTEST_SKIP() << "this build lacks nccl or gloo";
#else
  // The default backend on a GPU machine: the CPU collectives of the worker go over gloo, whatever
  // the number of GPUs (nccl is created lazily and never used).
  auto r = testing::run_process(
      {testing::cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--backend",
       "cpu:gloo,cuda:nccl", "--", testing::worker_path(), "collectives"},
      {{"PARATRAIN_TIMEOUT", "60"}}, 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(cpu:gloo,cuda:nccl): all collectives ok"), std::string::npos)
      << r.output;
#endif
}

TEST(Gpu, FusedGradScalerKernelsWithInjectedInfs) {
  SKIP_WITHOUT_CUDA();
  auto w = torch::ones({2}, torch::TensorOptions().device(kCuda0).requires_grad(true));
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
  amp::GradScaler s(amp::GradScalerOptions().init_scale(8.0).growth_interval(2));
  const std::vector<bool> overflow{false, false, true, false};
  const std::vector<double> want{8, 16, 8, 8};
  for (size_t i = 0; i < overflow.size(); ++i) {
    opt.zero_grad();
    const double x = overflow[i] ? std::numeric_limits<double>::infinity() : 1.0;
    auto before = w.detach().clone();
    s.scale((w * x).sum()).backward();
    EXPECT_EQ(s.step(opt), !overflow[i]) << "step " << i;
    s.update();
    EXPECT_EQ(torch::equal(before, w.detach()), overflow[i]) << "step " << i;
    EXPECT_EQ(s.get_scale(), want[i]) << "step " << i;
  }
}

TEST(Gpu, Fp16AtEveryOptLevelTrains) {
  SKIP_WITHOUT_CUDA();
  data::FashionMNIST train(data::kFashionMnistDir, data::FashionMNIST::Split::kTrain);
  auto x_all = train.images().slice(0, 0, 64 * 60).to(kCuda0);
  auto y_all = train.targets().slice(0, 0, 64 * 60).to(kCuda0);
  for (auto level : {amp::OptLevel::kO1, amp::OptLevel::kO2, amp::OptLevel::kO3}) {
    SCOPED_TRACE(amp::to_string(level));
    torch::manual_seed(0);
    auto model = models::make("cnn");
    model->to(kCuda0);
    amp::MixedPrecision mp(model, kCuda0, amp::AmpOptions().opt_level(level).dtype(torch::kHalf));
    torch::optim::SGD opt(mp.optimizer_parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    double first = 0;
    double last = 0;
    for (int s = 0; s < 60; ++s) {
      auto x = x_all.slice(0, s * 64, (s + 1) * 64);
      auto y = y_all.slice(0, s * 64, (s + 1) * 64);
      opt.zero_grad();
      torch::Tensor loss;
      {
        auto autocast = mp.autocast();
        loss = torch::nn::functional::cross_entropy(
            mp.cast_output(model->forward(mp.cast_input(x))), y);
      }
      mp.backward(loss);
      mp.step(opt);
      (s < 5 ? first : last) += s < 5 || s >= 55 ? loss.item<double>() / 5 : 0;
    }
    EXPECT_TRUE(std::isfinite(last));
    EXPECT_LT(last, first * 0.7) << "loss " << first << " -> " << last;
  }
}

torch::nn::Sequential three_layer_net() {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  net->push_back("fc0", torch::nn::Linear(12, 16));
  net->push_back("relu", torch::nn::ReLU());
  net->push_back("fc1", torch::nn::Linear(16, 16));
  net->push_back("relu1", torch::nn::ReLU());
  net->push_back("fc2", torch::nn::Linear(16, 5));
  return net;
}

void expect_same_grads_on_cpu(torch::nn::Sequential a, torch::nn::Sequential b) {
  auto pa = a->named_parameters();
  auto pb = b->named_parameters();
  for (const auto& kv : pa) {
    expect_close(kv.value().grad().cpu(), pb[kv.key()].grad().cpu(), kv.key());
  }
}

TEST(Gpu, DataParallelOnCudaDevices) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(1);
  auto x = torch::randn({10, 12});
  auto y = torch::randint(0, 5, {10});
  auto plain = three_layer_net();
  torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
  for (auto devices :
       {std::vector<torch::Device>{kCuda0}, std::vector<torch::Device>{kCuda0, kCuda0}}) {
    SCOPED_TRACE(std::to_string(devices.size()) + " replicas on cuda:0");
    auto net = three_layer_net();
    net->to(kCuda0);
    DataParallel dp(net, devices);
    auto out = dp(x.to(kCuda0));
    EXPECT_EQ(out.device(), kCuda0);
    torch::nn::functional::cross_entropy(out, y.to(kCuda0)).backward();
    expect_same_grads_on_cpu(plain, net);
  }
}

TEST(Gpu, PipelinesOnCudaAndMixedDevices) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  auto x = torch::randn({8, 12});
  auto y = torch::randint(0, 5, {8});
  auto ce = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target.to(out.device()));
  };
  auto plain = three_layer_net();
  ce(plain->forward(x), y).backward();
  // Repeated, and once under a stream of the caller's own: a CPU stage reading a GPU stage's
  // activation before the copy finished was intermittent (fixed by blocking copies to the CPU),
  // and stage threads must work on the caller's stream.
  const auto side = c10::impl::VirtualGuardImpl(torch::kCUDA).getStreamFromGlobalPool(kCuda0);
  for (auto devices :
       {std::vector<torch::Device>{kCuda0, kCuda0}, std::vector<torch::Device>{kCuda0, torch::kCPU},
        std::vector<torch::Device>{torch::kCPU, kCuda0}}) {
    for (auto schedule : {pipeline::Schedule::kGPipe, pipeline::Schedule::k1F1B}) {
      for (bool on_side_stream : {false, true}) {
        SCOPED_TRACE(pipeline::to_string(schedule) + " on " + devices[0].str() + "+" +
                     devices[1].str() + (on_side_stream ? ", on a side stream" : ""));
        std::optional<c10::StreamGuard> guard;
        if (on_side_stream) {
          guard.emplace(side);
        }
        auto net = three_layer_net();
        pipeline::Pipeline pipe(net, {3, 2}, devices, ce,
                                pipeline::PipelineOptions().chunks(4).schedule(schedule));
        for (int step = 0; step < 5; ++step) {
          net->zero_grad();
          auto loss = pipe.step(x.to(devices[0]), y);
          EXPECT_TRUE(std::isfinite(loss.item<double>()));
          expect_same_grads_on_cpu(plain, net);
        }
      }
    }
  }
}

TEST(Gpu, DistributedPipelineWireFollowsTheGroup) {
  SKIP_WITHOUT_CUDA();
#if !defined(PARATRAIN_WITH_NCCL) || !defined(PARATRAIN_WITH_GLOO)
  GTEST_SKIP() << "this build lacks nccl or gloo";
#else
  // nccl alone: device memory on the wire, GPipe only (an NCCL send may wait for its receive, and
  // under 1F1B both neighbours send first), and no CPU stages.
  auto nccl = world_of_one("nccl");
  auto ce = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  auto make = [&](torch::Device device, pipeline::Schedule schedule) {
    return pipeline::DistributedPipeline(three_layer_net(), 0, nccl, {0, 0}, device, ce,
                                         pipeline::PipelineOptions().schedule(schedule));
  };
  EXPECT_NO_THROW(make(kCuda0, pipeline::Schedule::kGPipe));
  std::string why = error_of([&] { make(kCuda0, pipeline::Schedule::k1F1B); });
  EXPECT_NE(why.find("cannot run over nccl alone"), std::string::npos) << why;
  why = error_of([&] { make(torch::kCPU, pipeline::Schedule::kGPipe); });
  EXPECT_NE(why.find("has no engine for CPU tensors"), std::string::npos) << why;
  // A routed group: host memory on the wire whatever each stage's device, so a cuda stage and a
  // cpu stage agree, under both schedules (two ranks sharing the one GPU never touch nccl).
  for (const std::string schedule : {"1f1b", "gpipe"}) {
    for (const std::string devices : {"cuda:0,cpu", "cuda:0,cuda:0"}) {
      SCOPED_TRACE(schedule + " on " + devices);
      testing::expect_every_rank_ok(PARATRAIN_TEST_PIPELINE_WORKER, "cpu:gloo,cuda:nccl", 2,
                                    {"--stages", "2", "--schedule", schedule, "--chunks", "4",
                                     "--devices", devices, "--tolerance", "1e-4"});
    }
  }
#endif
}

TEST(Gpu, PrefetchedBatchesEqualHostBatches) {
  SKIP_WITHOUT_CUDA();
  auto images = torch::rand({50, 1, 28, 28});
  auto targets = torch::arange(50);
  std::vector<size_t> order(50);
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = (i * 7) % 50;
  }
  auto adapt = [](const torch::Tensor& t) { return data::adapt_images(t, 56, 3); };
  data::TensorLoader host(images, targets, order, data::LoaderOptions(16));
  data::TensorLoader pinned(images, targets, order,
                            data::LoaderOptions(16).workers(2).pin_memory(true));
  data::DevicePrefetcher device(pinned, kCuda0, adapt);
  int batches = 0;
  while (auto want = host.next()) {
    auto got = device.next();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->data.device(), kCuda0);
    expect_close(got->data.cpu(), adapt(want->data), "batch data");
    EXPECT_TRUE(torch::equal(got->target.cpu(), want->target));
    ++batches;
  }
  EXPECT_EQ(batches, 4);
  EXPECT_FALSE(device.next().has_value());
}

// The GPT the FSDP tests train on cuda:0 (3 blocks of width 64, seed 0), and its batch: 4
// sequences of 16 tokens, the targets shifted by one.
struct SmallGpt {
  models::GptOptions shape =
      models::GptOptions().layers(3).width(64).heads(2).vocab(64).context(16);
  torch::Tensor x, y;
  SmallGpt() {
    torch::manual_seed(7);
    const auto tokens = torch::randint(0, 64, {4, 17}, torch::kLong).to(kCuda0);
    x = tokens.narrow(1, 0, 16);
    y = tokens.narrow(1, 1, 16);
  }
  torch::nn::Sequential model() const {
    torch::manual_seed(0);
    auto m = models::gpt(shape);
    m->to(kCuda0);
    return m;
  }
  torch::Tensor loss(const torch::Tensor& logits) const {
    return torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten());
  }
};

// FSDP on a GPU over nccl (its own reduce_scatter; the gathered and gradient blocks from the
// CUDA caching allocator through FSDP's pool) trains a GPT as one process does: one rank, so
// the collectives copy, and every parameter after 5 Adam steps within 1e-5 of the plain model's
// (kernels run in another order). The bf16 policy gives a finite, falling loss.
TEST(Gpu, FsdpOnNcclTrainsAsOneProcess) {
  SKIP_WITHOUT_CUDA();
#ifndef PARATRAIN_WITH_NCCL
  GTEST_SKIP() << "this build has no nccl (its libtorch has no CUDA)";
#else
  auto pg = world_of_one("nccl");
  const SmallGpt gpt;
  auto make = [&] { return gpt.model(); };
  const torch::Tensor& x = gpt.x;
  auto loss_of = [&](const torch::Tensor& logits) { return gpt.loss(logits); };
  auto plain = make();
  torch::optim::Adam plain_opt(plain->parameters(), torch::optim::AdamOptions(1e-3));
  auto sharded_model = make();
  FullyShardedDataParallel fsdp(sharded_model, pg,
                                FsdpOptions().units(models::gpt_block_names(sharded_model)));
  torch::optim::Adam fsdp_opt(fsdp.parameters(), torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 5; ++step) {
    plain_opt.zero_grad();
    loss_of(plain->forward(x)).backward();
    plain_opt.step();
    fsdp_opt.zero_grad();
    loss_of(fsdp.forward(x)).backward();
    fsdp_opt.step();
  }
  const auto state = fsdp.full_state();
  for (const auto& p : plain->named_parameters()) {
    ASSERT_TRUE(state.count(p.key())) << p.key();
    ASSERT_TRUE(state.at(p.key()).is_cuda()) << p.key();
    expect_close(state.at(p.key()).cpu(), p.value().detach().cpu(), p.key(), 1e-5);
  }

  auto bf16_model = make();
  FullyShardedDataParallel bf16(
      bf16_model, pg,
      FsdpOptions()
          .units(models::gpt_block_names(bf16_model))
          .mixed_precision(
              FsdpMixedPrecision().param_dtype(torch::kBFloat16).output_dtype(torch::kFloat))
          .activation_checkpointing(true));
  torch::optim::Adam bf16_opt(bf16.parameters(), torch::optim::AdamOptions(1e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    bf16_opt.zero_grad();
    auto l = loss_of(bf16.forward(x));
    l.backward();
    bf16_opt.step();
    last = l.item<double>();
    first = step == 0 ? last : first;
  }
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first);
#endif
}

// ZeRO-Offload: FSDP on a GPU whose FusedAdam keeps the moments in host memory or a file and
// steps host copies of the shards and gradients on the CPU, stepped after backward or unit by
// unit from FSDP's gradient hook (the optimizer in backward): after 5 steps every parameter within
// 1e-4 of FSDP with libtorch's Adam on the GPU, and the step lives on the host (the store holds
// the moments).
TEST(Gpu, FsdpOffloadsTheOptimizerToTheHost) {
  SKIP_WITHOUT_NCCL();
  auto pg = world_of_one("nccl");
  const SmallGpt gpt;
  const std::string dir = testing::make_temp_dir("gpu-offload");
  auto run = [&](const std::string& how) {
    auto model = gpt.model();
    FullyShardedDataParallel fsdp(model, pg, FsdpOptions().units(models::gpt_block_names(model)));
    std::unique_ptr<torch::optim::Optimizer> opt;
    std::shared_ptr<optim::OffloadStore> store;
    if (how == "device") {
      opt =
          std::make_unique<torch::optim::Adam>(fsdp.parameters(), torch::optim::AdamOptions(1e-3));
    } else {
      auto fused =
          std::make_unique<optim::FusedAdam>(fsdp.parameters(), torch::optim::AdamOptions(1e-3));
      store = std::make_shared<optim::OffloadStore>(
          optim::OffloadOptions().dir(how == "files" ? dir : ""));
      fused->offload(store);
      if (how == "in-backward") {
        optim::FusedAdam* f = fused.get();
        fsdp.register_post_accumulate_grad_hook(
            [f](const torch::Tensor& shard) { f->step_parameter(shard); });
      }
      opt = std::move(fused);
    }
    for (int step = 0; step < 5; ++step) {
      opt->zero_grad();
      gpt.loss(fsdp.forward(gpt.x)).backward();
      opt->step();
    }
    if (store) {
      EXPECT_GT(store->stored_bytes(), 0) << how;
      EXPECT_GT(store->bytes_read(), 0) << how;
    }
    std::map<std::string, torch::Tensor> out;
    for (const auto& [name, value] : fsdp.full_state()) {
      EXPECT_TRUE(value.is_cuda()) << how << ": " << name;
      out[name] = value.cpu();
    }
    return out;
  };
  const auto device = run("device");
  // Not bitwise: CUDA's Adam rounds otherwise than the CPU pass (addcdiv, fused multiply-adds),
  // and Adam turns a gradient that is rounding noise (the key's bias: softmax ignores a shift)
  // into steps of up to lr. 1e-4 is a tenth of one step: a unit not stepped, or not copied back,
  // fails it.
  for (const std::string how : {"host", "files", "in-backward"}) {
    const auto offloaded = run(how);
    EXPECT_EQ(offloaded.size(), device.size()) << how;
    for (const auto& [name, value] : device) {
      if (offloaded.count(name)) {
        expect_close(offloaded.at(name), value, how + ": " + name, 1e-4);
      } else {
        ADD_FAILURE() << how << ": no " << name;
      }
    }
  }
  testing::remove_tree(dir);
}

TEST(Gpu, MoreRanksThanGpusIsOneClearLine) {
  SKIP_WITHOUT_CUDA();
  const int gpus = static_cast<int>(torch::cuda::device_count());
  const std::string why = error_of([&] { dist::check_ranks_fit_gpus(gpus + 1, gpus); });
  EXPECT_NE(why.find(std::to_string(gpus + 1) + " ranks run on this node but it has " +
                     std::to_string(gpus) + " visible CUDA device"),
            std::string::npos)
      << why;
  auto r =
      testing::run_process({testing::cli_path(), "train", "--model", "linear", "--strategy", "ddp",
                            "--nproc", std::to_string(gpus + 1), "--epochs", "1", "--steps", "1"},
                           {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("each rank needs a GPU of its own"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace paratrain
