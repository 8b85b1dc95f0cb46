// The Trainer in process (every strategy against single-process training, exact resume, the
// language-model loss of sequence outputs), the learning-rate schedules against python3-torch,
// and checkpoints (atomic files, checksums, fallback, pruning, optimizer and RNG state).

#include "test_util.h"

#include "paratrain/comm/init.h"
#include "paratrain/data/dataset.h"
#include "paratrain/io/checkpoint.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/models/registry.h"
#include "paratrain/train/lr_schedule.h"
#include "paratrain/train/trainer.h"
#include "paratrain/util/trace.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

// 512 samples of 784 features in 10 linearly separable-ish classes.
data::DatasetPtr toy_data(int64_t n = 512, uint64_t seed = 1) {
  torch::manual_seed(static_cast<int64_t>(seed));
  torch::Tensor y = torch::randint(0, 10, {n}, torch::kLong);
  torch::Tensor centers = torch::randn({10, 784});
  torch::Tensor x = centers.index_select(0, y) + 0.5 * torch::randn({n, 784});
  return std::make_shared<data::TensorDataset>(x.view({n, 1, 28, 28}), y);
}

torch::nn::Sequential fresh(const std::string& name) {
  torch::manual_seed(0);
  return models::make(name, 10);
}

// The message of any exception f throws (the Trainer's own are not all c10::Error).
std::string thrown_by(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

// ---- learning-rate schedules ----------------------------------------------------------------

TEST(LRSchedule, MatchesPyTorch) {
  if (!python_has("torch")) {
    GTEST_SKIP() << test_python() << " has no torch to compute the reference lrs";
  }
  struct Case {
    LRScheduleOptions o;
    std::string milestones;
  };
  std::vector<Case> cases{
      {LRScheduleOptions().kind("step").step_size(3).gamma(0.5), "-"},
      {LRScheduleOptions().kind("multistep").milestones({2, 5, 9}).gamma(0.1), "2,5,9"},
      {LRScheduleOptions().kind("cosine").t_max(7).eta_min(0.001), "-"},
      {LRScheduleOptions().kind("cosine").t_max(6).warmup(4).warmup_start_factor(0.1), "-"},
      {LRScheduleOptions().kind("multistep").milestones({1, 3}).gamma(0.5).warmup(3), "1,3"},
      {LRScheduleOptions().kind("constant").warmup(5).warmup_start_factor(0.25), "-"},
  };
  for (const auto& c : cases) {
    const int n = 20;
    auto r = run_process(
        {test_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/../train/make_lr_reference.py",
         c.o.kind(), std::to_string(c.o.step_size()), exact(c.o.gamma()), c.milestones,
         std::to_string(c.o.t_max()), exact(c.o.eta_min()), std::to_string(c.o.warmup()),
         exact(c.o.warmup_start_factor()), std::to_string(n)},
        {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream in(r.output);
    auto params = std::vector<torch::Tensor>{torch::zeros({1}, torch::requires_grad())};
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
    LRSchedule schedule(opt, c.o);
    for (int t = 0; t < n; ++t) {
      double want = 0;
      ASSERT_TRUE(in >> want) << r.output;
      // PyTorch steps some schedules recursively: equal up to rounding.
      EXPECT_NEAR(schedule.lr(), want, 1e-12 + 1e-9 * std::abs(want))
          << c.o.kind() << " warmup " << c.o.warmup() << " at step " << t;
      EXPECT_DOUBLE_EQ(lr_at(c.o, 0.1, t), schedule.lr());
      schedule.step();
    }
  }
}

TEST(LRSchedule, BadOptions) {
  EXPECT_NE(error_of([] {
              check_lr_schedule(LRScheduleOptions().kind("poly"));
            }).find("unknown lr schedule 'poly': choose constant, step, multistep or cosine"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              check_lr_schedule(LRScheduleOptions().kind("multistep").milestones({5, 2}));
            }).find("milestones must be increasing"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              check_lr_schedule(LRScheduleOptions().warmup(2).warmup_start_factor(0));
            }).find("warmup_start_factor must be in (0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_optimizer({}, OptimizerOptions().kind("lamb"));
            }).find("unknown optimizer 'lamb': choose sgd, adam or adamw"),
            std::string::npos);
}

// ---- the Trainer ------------------------------------------------------------------------------

TrainerOptions base_options() {
  return TrainerOptions().epochs(2).batch_size(64).workers(0).optimizer(
      OptimizerOptions().kind("sgd").lr(0.05).momentum(0.9));
}

TEST(Trainer, EveryInProcessStrategyMatchesOneProcess) {
  auto data = toy_data();
  auto run = [&](TrainerOptions o) {
    Trainer t(fresh("linear"), data, data, o);
    auto results = t.fit();
    EXPECT_EQ(results.size(), 2u);
    EXPECT_GT(results.back().val_accuracy, 0.5);
    return t.weights();
  };
  const TensorMap single = run(base_options());
  const TensorMap dp =
      run(base_options().strategy(Strategy::kDataParallel).devices({torch::kCPU, torch::kCPU}));
  const TensorMap pipe = run(
      base_options().strategy(Strategy::kPipeline).devices({torch::kCPU, torch::kCPU}).chunks(4));
  for (const auto& kv : single) {
    expect_close(dp.at(kv.first), kv.second, "dp " + kv.first);
    expect_close(pipe.at(kv.first), kv.second, "pipeline " + kv.first);
  }
}

TEST(Trainer, DdpOnTwoThreadsMatchesOneProcess) {
  // Two ranks of a gloo group in this process, batch 32 each, against one process with batch
  // 64: the DistributedSampler gives rank r the samples r, r + 2, ... of the same permutation,
  // so each step sees the same 64 samples. linear has no BatchNorm, whose statistics would be
  // per rank.
  auto data = toy_data();
  Trainer one(fresh("linear"), data, nullptr, base_options());
  one.fit();
  const int port = free_port();
  std::vector<TensorMap> weights(2);
  std::vector<std::string> errors(2);
  std::vector<torch::nn::Sequential> models{fresh("linear"), fresh("linear")};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto pg =
            dist::init_process_group(dist::InitOptions()
                                         .backend("gloo")
                                         .init_method("tcp://127.0.0.1:" + std::to_string(port))
                                         .rank(r)
                                         .world_size(2)
                                         .uses_cuda(false));
        Trainer t(models[static_cast<size_t>(r)], data, nullptr,
                  base_options().strategy(Strategy::kDDP).process_group(pg).batch_size(32));
        t.fit();
        weights[static_cast<size_t>(r)] = t.weights();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) {
    t.join();
  }
  ASSERT_EQ(errors[0] + errors[1], "");
  expect_bitwise(weights[0], weights[1]);
  for (const auto& kv : one.weights()) {
    expect_close(weights[0].at(kv.first), kv.second, "ddp " + kv.first);
  }
}

TEST(Trainer, ResumeAfterAFailureIsBitwiseEqual) {
  // Adam, a warm-up into a cosine schedule stepped per step, accumulation of 2 batches and
  // clipping: a run stopped by an exception at step 11 and resumed ends where an uninterrupted
  // run does, bit for bit.
  auto data = toy_data();
  auto options = [&](const std::string& dir) {
    return base_options()
        .epochs(3)
        .optimizer(OptimizerOptions().kind("adam").lr(0.01))
        .lr_schedule(LRScheduleOptions().kind("cosine").t_max(8).warmup(3))
        .schedule_per_step(true)
        .accumulate(2)
        .clip_grad_norm(1.0)
        .workers(2)
        .checkpoint_dir(dir)
        .checkpoint_every(2)
        .resume("auto");
  };
  const std::string a = make_temp_dir("uninterrupted");
  Trainer whole(fresh("mlp"), data, data, options(a));
  whole.fit();

  const std::string b = make_temp_dir("resumed");
  {
    Trainer t(fresh("mlp"), data, data, options(b));
    t.on_step_end([](const StepInfo& s) {
      if (s.global_step == 11) {
        throw std::runtime_error("injected failure");
      }
    });
    EXPECT_NE(thrown_by([&] { t.fit(); }).find("injected failure"), std::string::npos);
  }
  Trainer resumed(fresh("mlp"), data, data, options(b));
  resumed.fit();
  EXPECT_NE(resumed.resumed_from().find("ckpt-0000000010.json"), std::string::npos)
      << resumed.resumed_from();
  EXPECT_EQ(resumed.global_step(), whole.global_step());
  expect_bitwise(whole.weights(), resumed.weights());
  expect_bitwise(optimizer_state(whole.optimizer()), optimizer_state(resumed.optimizer()));

  // Another model, or another config, is refused with the first difference.
  EXPECT_NE(error_of([&] {
              Trainer t(fresh("linear"), data, data, options(b));
              t.fit();
            }).find("is from another model"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              Trainer t(fresh("mlp"), data, data, options(b).config("{\"lr\": 0.5}"));
              t.fit();
            }).find("was made with another configuration: 'lr' is \"(unset)\" there and 0.5"),
            std::string::npos);
  remove_tree(a);
  remove_tree(b);
}

// An fsdp checkpoint is taken only by a model of the same layout: the same units, parameters and
// shapes. Here the LayerNorm's weight is [4, 6] in one model and [6, 4] in the other: the same
// names and sizes, so only the shapes tell them apart.
TEST(Trainer, FsdpResumeRefusesAnotherShape) {
  auto data = toy_data(128);
  auto model = [](int64_t rows) {
    torch::manual_seed(0);
    const int64_t cols = 24 / rows;
    return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 24),
                                 torch::nn::Unflatten(torch::nn::UnflattenOptions(1, {rows, cols})),
                                 torch::nn::LayerNorm(torch::nn::LayerNormOptions({rows, cols})),
                                 torch::nn::Flatten(), torch::nn::Linear(24, 10));
  };
  const std::string path = "/tmp/" + unique_token("fsdp-shape-store");
  auto pg = dist::init_process_group(
      dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
  const std::string dir = make_temp_dir("fsdp-shape");
  auto options = base_options()
                     .epochs(1)
                     .strategy(Strategy::kFSDP)
                     .process_group(pg)
                     .checkpoint_dir(dir)
                     .checkpoint_every_epoch(true)
                     .resume("auto");
  {
    Trainer t(model(4), data, nullptr, options);
    t.fit();
  }
  const std::string e = error_of([&] {
    Trainer t(model(6), data, nullptr, options.epochs(2));
    t.fit();
  });
  EXPECT_NE(e.find("has '3.weight' of shape [4, 6] in it but [6, 4] here"), std::string::npos) << e;
  remove_tree(dir);
}

// resume "auto" over checkpoints that are all damaged fails, deletes nothing, and names the
// option that starts from step 0 beside them; with it, the run trains from step 0 and leaves
// them as they were (rotation deletes only this run's older checkpoints).
TEST(Trainer, EveryCheckpointDamagedFailsUnlessAFreshStartIsChosen) {
  auto data = toy_data(256);  // 4 steps of 64
  const std::string dir = make_temp_dir("all-damaged");
  auto options = [&]() {
    return base_options().epochs(1).checkpoint_dir(dir).checkpoint_every(2).keep(2).resume("auto");
  };
  {
    Trainer t(fresh("linear"), data, nullptr, options());
    t.fit();
  }
  ASSERT_EQ(::truncate((dir + "/ckpt-0000000004.safetensors").c_str(), 10), 0);
  ASSERT_EQ(::truncate((dir + "/ckpt-0000000002.safetensors").c_str(), 10), 0);
  const auto damaged = files_in(dir);
  ASSERT_EQ(damaged.size(), 6u);  // steps 2 and 4: manifest, shared file, rank file
  const std::string e = error_of([&] {
    Trainer t(fresh("linear"), data, nullptr, options());
    t.fit();
  });
  EXPECT_NE(e.find("every checkpoint in '" + dir +
                   "' is damaged (2 of them; the newest, ckpt-0000000004: " + dir +
                   "/ckpt-0000000004.safetensors has 10 bytes"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("set start_fresh_if_damaged to start from step 0"), std::string::npos) << e;
  EXPECT_EQ(files_in(dir), damaged);
  // In the library's terms, naming the option: a command line maps the field to its flag.
  auto field_of = [&](const TrainerOptions& o) {
    try {
      Trainer t(fresh("linear"), data, nullptr, o);
      t.fit();
    } catch (const OptionError& error) {
      EXPECT_EQ(std::string(error.what_without_backtrace()).find("--"), std::string::npos)
          << error.what_without_backtrace();
      return error.field();
    }
    return std::string("(no OptionError)");
  };
  EXPECT_EQ(field_of(options()), "start_fresh_if_damaged");
  EXPECT_EQ(field_of(options().resume("")), "checkpoint_dir");  // another run's checkpoints

  Trainer t(fresh("linear"), data, nullptr,
            options().checkpoint_every(3).start_fresh_if_damaged(true));
  t.fit();
  EXPECT_EQ(t.resumed_from(), "");
  EXPECT_EQ(t.global_step(), 4);
  const auto now = files_in(dir);
  EXPECT_TRUE(now.count("ckpt-0000000003.json"));
  for (const auto& [name, bytes] : damaged) {
    ASSERT_TRUE(now.count(name)) << name << " was deleted";
    EXPECT_TRUE(now.at(name) == bytes) << name << " changed";
  }
  remove_tree(dir);
}

// A run resumed from a checkpoint of an epoch's last step trains none of that epoch: its result
// says so (no invented loss or throughput), and its metrics row is marked "resumed".
TEST(Trainer, AResumeAtAnEpochsEndInventsNoTrainingResult) {
  auto data = toy_data(256);  // 4 steps of 64
  const std::string dir = make_temp_dir("epoch-end");
  auto options = [&](int64_t epochs) {
    return base_options()
        .epochs(epochs)
        .checkpoint_dir(dir + "/ckpt")
        .checkpoint_every(4)
        .resume("auto")
        .metrics(dir + "/metrics.jsonl");
  };
  {
    Trainer t(fresh("linear"), data, data, options(1));
    t.fit();
  }
  Trainer t(fresh("linear"), data, data, options(2));
  const auto results = t.fit();
  EXPECT_NE(t.resumed_from().find("ckpt-0000000004.json"), std::string::npos) << t.resumed_from();
  ASSERT_EQ(results.size(), 2u);
  EXPECT_FALSE(results[0].trained);
  EXPECT_TRUE(std::isnan(results[0].train_loss)) << results[0].train_loss;
  EXPECT_TRUE(std::isnan(results[0].images_per_sec)) << results[0].images_per_sec;
  EXPECT_GT(results[0].val_accuracy, 0.0);  // this run's evaluation of the restored weights
  EXPECT_TRUE(results[1].trained);
  EXPECT_GT(results[1].train_loss, 0.0);
  EXPECT_GT(results[1].images_per_sec, 0.0);
  std::ifstream in(dir + "/metrics.jsonl");
  std::vector<std::string> epoch_rows;
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"val_accuracy\"") != std::string::npos) {
      epoch_rows.push_back(line);
    }
  }
  ASSERT_EQ(epoch_rows.size(), 3u);  // epoch 1, then epoch 1 again (resumed) and epoch 2
  EXPECT_NE(epoch_rows[1].find("\"resumed\":true"), std::string::npos) << epoch_rows[1];
  EXPECT_EQ(epoch_rows[1].find("train_loss"), std::string::npos) << epoch_rows[1];
  EXPECT_NE(epoch_rows[2].find("\"train_loss\""), std::string::npos) << epoch_rows[2];
  remove_tree(dir);
}

TEST(Trainer, NonFiniteLossStopsWithStepAndRank) {
  // One sample holds a NaN: the step whose batch has it stops the run.
  torch::Tensor x = torch::randn({256, 1, 28, 28});
  x[100][0][3][3] = std::numeric_limits<float>::quiet_NaN();
  auto data = std::make_shared<data::TensorDataset>(x, torch::randint(0, 10, {256}));
  Trainer t(fresh("linear"), data, nullptr, base_options());
  const std::string e = thrown_by([&] { t.fit(); });
  EXPECT_NE(e.find("the loss is nan at step "), std::string::npos) << e;
  EXPECT_NE(e.find(") on rank 0: lower the learning rate"), std::string::npos) << e;
  EXPECT_LT(t.global_step(), 4);  // it stopped in the first epoch
}

TEST(Trainer, SequenceOutputsTrainOnTheLanguageModelLoss) {
  // A bigram model (Embedding, then Linear) on token sequences whose next token is 3x + 1 mod 17:
  // outputs [B, T, V] against targets [B, T] are B * T classifications, PyTorch's language-model
  // loss. Evaluation reports the per-token accuracy and the mean cross entropy over the whole
  // validation set, as computed here in one go (up to float rounding: the batches differ).
  const int64_t n = 96;
  const int64_t t = 12;
  const int64_t v = 17;
  torch::manual_seed(3);
  const torch::Tensor x = torch::randint(0, v, {n, t}, torch::kLong);
  const torch::Tensor y = (x * 3 + 1).remainder(v);
  auto data = std::make_shared<data::TensorDataset>(x, y);
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Embedding(v, 16), torch::nn::Linear(16, v));
  const std::string dir = make_temp_dir("lm");
  Trainer trainer(model, data, data,
                  base_options()
                      .epochs(6)
                      .batch_size(16)
                      .optimizer(OptimizerOptions().kind("adam").lr(0.05))
                      .metrics(dir + "/metrics.jsonl"));
  const auto results = trainer.fit();
  const EpochResult& last = results.back();
  EXPECT_LT(last.train_loss, results.front().train_loss);
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    model->eval();
    out = model->forward(x);
  }
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{n, t, v}));
  const double loss =
      torch::nn::functional::cross_entropy(out.flatten(0, 1), y.flatten()).item<double>();
  const double accuracy = out.argmax(-1).eq(y).to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(last.val_loss, loss, 1e-5 * std::max(1.0, loss));
  EXPECT_NEAR(last.val_accuracy, accuracy, 1.5 / static_cast<double>(n * t));
  EXPECT_GT(last.val_accuracy, 0.9);  // a bigram model learns a bigram rule
  // The epoch rows carry val_loss beside val_accuracy.
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  std::string last_row;
  while (std::getline(in, line)) {
    last_row = line;
  }
  EXPECT_NE(last_row.find("\"val_loss\":"), std::string::npos) << last_row;

  // A classifier's val_loss is its mean cross entropy over the validation set likewise.
  auto classes = toy_data(128);
  Trainer classifier(fresh("linear"), classes, classes, base_options().epochs(1));
  const double val_loss = classifier.fit().back().val_loss;
  torch::Tensor all_x = torch::empty({128, 1, 28, 28});
  torch::Tensor all_y = torch::empty({128}, torch::kLong);
  for (size_t i = 0; i < 128; ++i) {
    const data::Sample s = classes->get(i);
    all_x[static_cast<int64_t>(i)] = s.data;
    all_y[static_cast<int64_t>(i)] = s.target;
  }
  torch::NoGradGuard no_grad;
  classifier.model()->eval();
  const double want =
      torch::nn::functional::cross_entropy(classifier.model()->forward(all_x), all_y)
          .item<double>();
  EXPECT_NEAR(val_loss, want, 1e-5 * std::max(1.0, want));
  remove_tree(dir);
}

// Each bad option is an OptionError that names its field, in the options' own words (the
// command line maps the field to its flag: tests/cli).
TEST(Trainer, BadOptions) {
  auto data = toy_data(64);
  auto expect = [&](const TrainerOptions& o, const std::string& field, const std::string& message) {
    try {
      Trainer t(fresh("linear"), data, nullptr, o);
      ADD_FAILURE() << "no error for " << field;
    } catch (const OptionError& e) {
      EXPECT_EQ(e.field(), field);
      EXPECT_NE(std::string(e.what_without_backtrace()).find(message), std::string::npos)
          << e.what_without_backtrace();
    }
  };
  expect(base_options().accumulate(0), "accumulate", "accumulate must be >= 1, got 0");
  expect(base_options().checkpoint_every(5), "checkpoint_dir",
         "checkpoint_every needs checkpoint_dir");
  expect(base_options().resume("auto"), "checkpoint_dir",
         "resume auto needs checkpoint_dir (where to look)");
  expect(base_options().strategy(Strategy::kDDP), "process_group",
         "strategy ddp needs a process_group");
  expect(base_options().checkpoint_dir("/tmp").keep(0), "keep", "keep must be >= 1, got 0");
  expect(base_options().start_fresh_if_damaged(true), "start_fresh_if_damaged",
         "start_fresh_if_damaged says what resume auto does when every checkpoint is damaged: "
         "add resume auto");
  expect(base_options().zero_checkpoint("both"), "zero_checkpoint",
         "zero_checkpoint is 'both': use consolidated or sharded");
  expect(base_options().strategy(Strategy::kDataParallel), "devices", "strategy dp needs devices");
  try {
    check_trainer_options(base_options().epochs(0));  // without building anything
    ADD_FAILURE() << "epochs 0 passed";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.field(), "epochs");
  }
}

// On a device, offload takes the optimizer (ZeRO-Offload: its moments in host memory or the
// files, Adam on the CPU) and refuses gradients and params, which FSDP's collectives need on the
// device. The options are checked before anything touches the device, so this runs without one.
TEST(Trainer, OffloadOnADeviceTakesTheOptimizerOnly) {
  auto pg =
      dist::init_process_group(dist::InitOptions()
                                   .backend("gloo")
                                   .init_method("tcp://127.0.0.1:" + std::to_string(free_port()))
                                   .rank(0)
                                   .world_size(1)
                                   .uses_cuda(false));
  auto on_gpu = [&](TrainOffloadOptions off) {
    return base_options()
        .strategy(Strategy::kFSDP)
        .process_group(pg)
        .device(torch::Device(torch::kCUDA, 0))
        .optimizer(OptimizerOptions().kind("adam").lr(1e-3))
        .offload(off);
  };
  check_trainer_options(on_gpu(TrainOffloadOptions().optimizer(true)));
  for (const auto& off : {TrainOffloadOptions().optimizer(true).gradients(true),
                          TrainOffloadOptions().optimizer(true).params(true)}) {
    try {
      check_trainer_options(on_gpu(off));
      ADD_FAILURE() << "gradients or params offloaded from a GPU passed";
    } catch (const OptionError& e) {
      EXPECT_EQ(e.field(), "offload");
      EXPECT_NE(std::string(e.what_without_backtrace())
                    .find("on device cuda:0 offload takes the optimizer"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
