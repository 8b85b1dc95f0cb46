// Offload tiers (optim/offload.h): an OffloadStore's blocks in a file and in host memory, their
// checksums, the directories it refuses, a full disk; the fused Adam with its moments offloaded
// is bitwise equal to the same steps in memory, and its checkpoints move between the tiers.

#include "paratrain/optim/offload.h"
#include "paratrain/comm/init.h"
#include "paratrain/comm/process_group.h"
#include "paratrain/io/checkpoint.h"
#include "paratrain/models/gpt.h"
#include "paratrain/optim/fused.h"
#include "paratrain/parallel/fsdp_checkpoint.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace {

using optim::OffloadOptions;
using optim::OffloadStore;

using testing::error_of;

// A directory of the test's own, removed after it.
struct TempDir {
  explicit TempDir(const std::string& name) : at(testing::make_temp_dir(name)) {}
  ~TempDir() { testing::remove_tree(at); }
  const std::string& path() const { return at; }
  std::string at;
};

TEST(Offload, BlocksRoundTripInAFileAndInHostMemory) {
  TempDir dir("offload-blocks");
  for (const std::string& where : {dir.path(), std::string()}) {
    OffloadStore store(OffloadOptions().dir(where));
    EXPECT_EQ(store.on_disk(), !where.empty());
    store.reserve("a", 10000 * 4);
    store.reserve("b", 3 * 4);
    EXPECT_THROW(store.reserve("a", 8), c10::Error);  // another size
    torch::Tensor a = OffloadStore::buffer(10000, torch::kFloat);
    a.copy_(torch::randn({10000}));
    const torch::Tensor saved = a.clone();
    torch::Tensor back = OffloadStore::buffer(10000, torch::kFloat);
    store.wait(store.read("a", back.data_ptr()));  // never written: zeros
    EXPECT_EQ(back.abs().max().item<float>(), 0.0f);
    store.wait(store.write("a", a.data_ptr()));
    a.zero_();
    store.wait(store.read("a", back.data_ptr()));
    EXPECT_TRUE(torch::equal(back, saved)) << where;
    EXPECT_TRUE(store.written("a"));
    store.discard("a");
    EXPECT_FALSE(store.written("a"));
    store.wait(store.read("a", back.data_ptr()));
    EXPECT_EQ(back.abs().max().item<float>(), 0.0f);
    EXPECT_EQ(store.bytes_written(), 40000);
    if (store.on_disk()) {
      EXPECT_EQ(store.stored_bytes(), optim::offload_block_bytes(40000) + 4096);
      EXPECT_TRUE(testing::files_in(dir.path()).empty()) << "the file has no name";
    }
  }
}

TEST(Offload, ACorruptedBlockFailsItsChecksumInOneLine) {
  TempDir dir("offload-corrupt");
  OffloadStore store(OffloadOptions().dir(dir.path()).owner("rank 3"));
  store.reserve("0.1.exp_avg", 4096 * 4);
  torch::Tensor t = OffloadStore::buffer(4096, torch::kFloat);
  t.fill_(1.5f);
  store.wait(store.write("0.1.exp_avg", t.data_ptr()));
  const int fd = ::open(store.descriptor_path().c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const float wrong = 2.5f;
  ASSERT_EQ(::pwrite(fd, &wrong, sizeof wrong, 400), static_cast<ssize_t>(sizeof wrong));
  ::close(fd);
  const std::string why = error_of([&] { store.wait(store.read("0.1.exp_avg", t.data_ptr())); });
  EXPECT_NE(why.find("block '0.1.exp_avg'"), std::string::npos) << why;
  EXPECT_NE(why.find(store.file()), std::string::npos) << why;
  EXPECT_NE(why.find("rank 3"), std::string::npos) << why;
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
}

TEST(Offload, DirectoriesThatCannotHoldStateAreRefused) {
  TempDir dir("offload-dirs");
  EXPECT_NE(optim::offload_dir_problem(dir.path() + "/missing").find("does not exist"),
            std::string::npos);
  std::ofstream(dir.path() + "/file") << "x";
  EXPECT_NE(optim::offload_dir_problem(dir.path() + "/file").find("not a directory"),
            std::string::npos);
  EXPECT_EQ(optim::offload_dir_problem(dir.path()), "");
  EXPECT_THROW(OffloadStore(OffloadOptions().dir(dir.path() + "/missing")), c10::Error);
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) == 0 && fs.f_type == 0x01021994) {  // TMPFS_MAGIC
    const std::string why = optim::offload_dir_problem("/dev/shm");
    EXPECT_NE(why.find("tmpfs, which is memory"), std::string::npos) << why;
  } else {
    std::cout << "[ note ] /dev/shm is not tmpfs here; the tmpfs refusal is not exercised\n";
  }
  if (::geteuid() != 0) {  // root may write anywhere
    ASSERT_EQ(::chmod(dir.path().c_str(), 0500), 0);
    EXPECT_NE(optim::offload_dir_problem(dir.path()).find("not writable"), std::string::npos);
    ::chmod(dir.path().c_str(), 0700);
  }
}

// A disk too small for the state: an ext4 of 8 MiB that the test loop-mounts and unmounts
// (root only; skipped, saying why, elsewhere).
TEST(Offload, AFullDiskFailsWhenTheBlockIsReserved) {
  TempDir dir("offload-full");
  const std::string image = dir.path() + "/disk.img", mnt = dir.path() + "/mnt";
  ASSERT_EQ(::mkdir(mnt.c_str(), 0700), 0);
  const std::string make = "truncate -s 8M " + image + " && mkfs.ext4 -q " + image +
                           " 2>/dev/null && mount -o loop " + image + " " + mnt + " 2>/dev/null";
  if (::geteuid() != 0 || std::system(make.c_str()) != 0) {
    GTEST_SKIP() << "needs root and loop devices to mount a small ext4";
  }
  struct Unmount {
    std::string at;
    ~Unmount() { ::umount2(at.c_str(), MNT_DETACH); }
  } unmount{mnt};
  OffloadStore store(OffloadOptions().dir(mnt).owner("rank 0"));
  store.reserve("small", 1 << 20);
  const std::string why = error_of([&] { store.reserve("large", 64 << 20); });
  EXPECT_NE(why.find("block 'large'"), std::string::npos) << why;
  EXPECT_NE(why.find("No space left on device"), std::string::npos) << why;
  EXPECT_NE(why.find("another --offload-dir"), std::string::npos) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  torch::Tensor t = OffloadStore::buffer(1 << 18, torch::kFloat);
  t.fill_(3.0f);
  store.wait(store.write("small", t.data_ptr()));  // what was reserved still works
  EXPECT_LT(optim::offload_free_bytes(mnt), 8 << 20);
}

// 20 steps of a small GPT with the moments in memory, in a file and in host memory: the same
// bits. `amsgrad` adds the third moment, AdamW the decoupled decay.
template <typename Fused, typename Options>
std::vector<torch::Tensor> gpt_steps(const Options& options, const std::string& tier, int steps) {
  torch::manual_seed(0);
  auto model = models::gpt(models::GptOptions().layers(2).width(32).heads(4).vocab(61).context(16));
  Fused opt(model->parameters(), options);
  std::shared_ptr<OffloadStore> store;
  if (tier != "memory") {
    store = std::make_shared<OffloadStore>(OffloadOptions().dir(tier == "host" ? "" : tier));
    opt.offload(store);
  }
  for (int step = 0; step < steps; ++step) {
    const auto tokens = torch::randint(61, {4, 17});
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(tokens.slice(1, 0, 16)).reshape({-1, 61}),
                                         tokens.slice(1, 1, 17).reshape(-1))
        .backward();
    opt.step();
  }
  if (store) {
    EXPECT_GT(store->bytes_read(), 0);
    EXPECT_GT(store->stored_bytes(), 0);
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

void expect_bitwise(const std::vector<torch::Tensor>& a,
                    const std::vector<torch::Tensor>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ": parameter " << i;
  }
}

TEST(Offload, OffloadedAdamIsBitwiseEqualToAdamInMemory) {
  TempDir dir("offload-adam");
  const auto adam = torch::optim::AdamOptions(1e-3).weight_decay(0.01);
  const auto amsgrad = torch::optim::AdamOptions(1e-3).amsgrad(true);
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
  const auto in_memory = gpt_steps<optim::FusedAdam>(adam, "memory", 20);
  expect_bitwise(gpt_steps<optim::FusedAdam>(adam, dir.path(), 20), in_memory, "adam, files");
  expect_bitwise(gpt_steps<optim::FusedAdam>(adam, "host", 20), in_memory, "adam, host");
  expect_bitwise(gpt_steps<optim::FusedAdam>(amsgrad, dir.path(), 20),
                 gpt_steps<optim::FusedAdam>(amsgrad, "memory", 20), "amsgrad, files");
  expect_bitwise(gpt_steps<optim::FusedAdamW>(adamw, dir.path(), 20),
                 gpt_steps<optim::FusedAdamW>(adamw, "memory", 20), "adamw, files");
}

// Checkpoints hold the offloaded moments, and load across the tiers: state saved from memory
// continues offloaded, and the other way round, bitwise as if nothing had moved.
TEST(Offload, CheckpointsMoveBetweenTheTiers) {
  TempDir dir("offload-checkpoint");
  torch::manual_seed(1);
  std::vector<torch::Tensor> start = {torch::randn({300}), torch::randn({7, 11})};
  auto run = [&](const std::string& first, const std::string& second) {
    std::vector<torch::Tensor> params;
    for (const auto& t : start) {
      params.push_back(t.clone().requires_grad_());
    }
    auto make = [&](const std::string& tier) {
      auto opt = std::make_unique<optim::FusedAdam>(params, torch::optim::AdamOptions(1e-2));
      if (tier != "memory") {
        opt->offload(std::make_shared<OffloadStore>(OffloadOptions().dir(tier)));
      }
      return opt;
    };
    auto step = [&](torch::optim::Optimizer& opt, int i) {
      for (auto& p : params) {
        p.mutable_grad() = torch::sin(p.detach() * (i + 1));
      }
      opt.step();
    };
    auto opt = make(first);
    for (int i = 0; i < 3; ++i) {
      step(*opt, i);
    }
    const TensorMap saved = optimizer_state(*opt);
    EXPECT_EQ(saved.at("0.0.exp_avg").numel(), 300);
    auto next = make(second);
    load_optimizer_state(*next, saved);
    for (int i = 3; i < 6; ++i) {
      step(*next, i);
    }
    TensorMap out = optimizer_state(*next);
    for (size_t i = 0; i < params.size(); ++i) {
      out["param." + std::to_string(i)] = params[i].detach().clone();
    }
    return out;
  };
  const TensorMap memory = run("memory", "memory");
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {"memory", dir.path()}, {dir.path(), "memory"}, {dir.path(), dir.path()}}) {
    const TensorMap moved = run(first, second);
    ASSERT_EQ(moved.size(), memory.size());
    for (const auto& [key, value] : memory) {
      EXPECT_TRUE(torch::equal(moved.at(key), value))
          << key << " (" << first << " then " << second << ")";
    }
  }
}

TEST(Offload, StateComesBackAndSgdIsRefused) {
  TempDir dir("offload-back");
  torch::Tensor p = torch::randn({1000}).requires_grad_();
  optim::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2));
  auto store = std::make_shared<OffloadStore>(OffloadOptions().dir(dir.path()));
  opt.offload(store);
  p.mutable_grad() = torch::ones({1000});
  opt.step();
  const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().begin()->second);
  EXPECT_EQ(st.exp_avg().numel(), 0) << "the moments are in the store";
  opt.offload(nullptr);
  EXPECT_EQ(st.exp_avg().numel(), 1000);
  EXPECT_NEAR(st.exp_avg()[0].item<float>(), 0.1f, 1e-7);
  opt.step();  // in memory again
  EXPECT_TRUE(opt.last_step_fused());
  torch::Tensor q = torch::randn({10}).requires_grad_();
  optim::FusedSGD sgd({q}, torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::string why = error_of([&] { sgd.offload(store); });
  EXPECT_NE(why.find("FusedAdam or FusedAdamW"), std::string::npos) << why;
  // A parameter the pass cannot take fails the offloaded step instead of falling back.
  torch::Tensor half = torch::randn({8, 8}, torch::kBFloat16).requires_grad_();
  optim::FusedAdam offloaded({half}, torch::optim::AdamOptions(1e-2));
  offloaded.offload(store);
  half.mutable_grad() = torch::ones({8, 8}, torch::kBFloat16);
  const std::string refused = error_of([&] { offloaded.step(); });
  EXPECT_NE(refused.find("the offloaded pass takes dense fp32 CPU or CUDA tensors"),
            std::string::npos)
      << refused;
  // Nor an expanded view, whose stepped values could not be copied back.
  torch::Tensor expanded = torch::randn({1, 8}).expand({8, 8}).requires_grad_();
  optim::FusedAdam overlapping({expanded}, torch::optim::AdamOptions(1e-2));
  overlapping.offload(store);
  expanded.mutable_grad() = torch::ones({8, 8});
  EXPECT_NE(error_of([&] { overlapping.step(); }).find("dense fp32 CPU or CUDA"),
            std::string::npos);
}

// A copy of `t` laid out `how`: "contiguous", "strided" (a transposed matrix, every other element
// of a vector: the pass cannot use them in place) or on a device ("cuda").
torch::Tensor lay_out(const torch::Tensor& t, const std::string& how) {
  if (how != "strided") {
    return t.to(torch::Device(how == "contiguous" ? "cpu" : how), /*non_blocking=*/false,
                /*copy=*/true);
  }
  torch::Tensor out = t.dim() == 2 ? torch::empty({t.size(1), t.size(0)}).t()
                                   : torch::empty({2 * t.numel()}).slice(0, 0, 2 * t.numel(), 2);
  return out.copy_(t);
}

// `start` as parameters laid out `how`.
std::vector<torch::Tensor> laid_out(const std::vector<torch::Tensor>& start,
                                    const std::string& how) {
  std::vector<torch::Tensor> out;
  for (const auto& t : start) {
    out.push_back(lay_out(t, how).requires_grad_());
  }
  return out;
}

// 9 Adam steps with the moments offloaded (`tier`) of parameters laid out `how`: 3 by step(), 4
// by step_parameter (the optimizer in backward) and step(), 2 by step(). The gradients are
// computed on the CPU from the values, so every layout sees the same ones. After steps 4, 5 and 6
// the state goes through a checkpoint into a new optimizer: loaded into an offloaded one (its
// moments then wait on the host), or loaded first, laid out `how`, and offloaded after (state in
// memory, on a GPU or strided, moves into the store at the next step). Returns the values and
// the state, on the CPU.
TensorMap staged_steps(const std::string& how, const std::string& tier) {
  torch::manual_seed(3);
  const std::vector<torch::Tensor> start = {torch::randn({300}), torch::randn({7, 11})};
  std::vector<torch::Tensor> params = laid_out(start, how);
  const bool offloaded = tier != "memory";
  auto store = [&] {
    return std::make_shared<OffloadStore>(OffloadOptions().dir(tier == "host" ? "" : tier));
  };
  auto make = [&](bool offload) {
    auto opt = std::make_unique<optim::FusedAdam>(
        params, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
    if (offload) {
      opt->offload(store());
    }
    return opt;
  };
  auto gradients = [&](int i) {
    for (auto& p : params) {
      const torch::Tensor g = torch::sin(p.detach().cpu() * (i + 1));
      p.mutable_grad() = torch::empty_like(p).copy_(g);  // the parameter's layout and device
    }
  };
  auto opt = make(offloaded);
  for (int i = 0; i < 9; ++i) {
    gradients(i);
    if (i >= 3 && i < 7 && offloaded) {
      for (auto& p : params) {
        opt->step_parameter(p);
      }
    }
    opt->step();
    if (i == 5) {
      const TensorMap saved = optimizer_state(*opt);
      opt = make(offloaded);
      load_optimizer_state(*opt, saved);
      for (const auto& kv : opt->state()) {
        const auto& st = static_cast<const torch::optim::AdamParamState&>(*kv.second);
        EXPECT_TRUE(st.exp_avg().device().is_cpu() || !offloaded) << how << ": on the host";
      }
    } else if (i == 4 || i == 6) {
      const TensorMap saved = optimizer_state(*opt);
      opt = make(false);
      load_optimizer_state(*opt, saved);
      for (auto& kv : opt->state()) {
        auto& st = static_cast<torch::optim::AdamParamState&>(*kv.second);
        st.exp_avg(lay_out(st.exp_avg(), how));
        st.exp_avg_sq(lay_out(st.exp_avg_sq(), how));
      }
      if (offloaded) {
        opt->offload(store());
      }
    }
  }
  TensorMap out;
  for (const auto& [key, value] : optimizer_state(*opt)) {
    out[key] = value.cpu();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    out["param." + std::to_string(i)] = params[i].detach().cpu().contiguous();
  }
  return out;
}

void expect_same_map(const TensorMap& a, const TensorMap& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [key, value] : b) {
    ASSERT_TRUE(a.count(key)) << what << ": " << key;
    EXPECT_TRUE(torch::equal(a.at(key), value)) << what << ": " << key;
  }
}

// Parameters the offloaded pass cannot use in place are stepped from host copies and copied
// back: strided ones here, a GPU's (ZeRO-Offload: the moments in host memory or a file, Adam on
// the CPU) in Offload.GpuParametersStepOnTheHost. The same bits as contiguous parameters in
// memory, through step(), step_parameter() and a checkpoint.
TEST(Offload, StridedParametersAreSteppedFromHostCopies) {
  TempDir dir("offload-staged");
  const TensorMap reference = staged_steps("contiguous", "memory");
  expect_same_map(staged_steps("strided", dir.path()), reference, "strided, files");
  expect_same_map(staged_steps("strided", "host"), reference, "strided, host");
  expect_same_map(staged_steps("contiguous", "host"), reference, "contiguous, host");
}

TEST(Offload, GpuParametersStepOnTheHost) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device (this test runs the offloaded step of GPU parameters)";
  }
  TempDir dir("offload-gpu");
  const TensorMap reference = staged_steps("contiguous", "memory");
  expect_same_map(staged_steps("cuda", "host"), reference, "cuda, host");
  expect_same_map(staged_steps("cuda", dir.path()), reference, "cuda, files");
  // Another store keeps the moments off the GPU; offload(nullptr) brings them back to it, where
  // libtorch's step then takes over.
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  torch::Tensor p = torch::randn({1000}, cuda).requires_grad_();
  optim::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2));
  opt.offload(std::make_shared<OffloadStore>());
  p.mutable_grad() = torch::ones({1000}, cuda);
  opt.step();
  opt.offload(std::make_shared<OffloadStore>());
  const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().begin()->second);
  EXPECT_TRUE(st.exp_avg().device().is_cpu());
  EXPECT_EQ(st.exp_avg().numel(), 1000);
  opt.offload(nullptr);
  EXPECT_TRUE(st.exp_avg().is_cuda());
  opt.step();
  EXPECT_FALSE(opt.last_step_fused());
}

// FSDP with its gradients, its shards or both in the store, and Adam's moments there too: 20
// steps (each two backward passes summed, the first without synchronizing, then clipped) end
// bitwise where the same training in memory ends, in a file and in host memory; a checkpoint of
// either kind loads into the other.
struct FsdpRun {
  std::map<std::string, torch::Tensor> weights;
  TensorMap moments;
};

FsdpRun fsdp_steps(const dist::ProcessGroupPtr& pg,
                   const std::string& tier,
                   bool gradients,
                   bool params,
                   const std::string& save_to = "",
                   const std::string& load_from = "",
                   bool in_backward = false,
                   bool clip = true) {
  torch::manual_seed(3);
  auto model = models::gpt(models::GptOptions().layers(3).width(32).heads(4).vocab(61).context(16));
  std::shared_ptr<OffloadStore> store;
  if (tier != "memory") {
    store = std::make_shared<OffloadStore>(OffloadOptions().dir(tier == "host" ? "" : tier));
  }
  FullyShardedDataParallel fsdp(
      model, pg,
      FsdpOptions()
          .units(models::gpt_block_names(model))
          .offload(FsdpOffloadPolicy().store(store).gradients(gradients).params(params)));
  optim::FusedAdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  if (store) {
    opt.offload(store);
  }
  if (!load_from.empty()) {
    load_sharded_checkpoint(load_from, fsdp, &opt);
  }
  if (in_backward) {
    fsdp.register_post_accumulate_grad_hook(
        [&opt](const torch::Tensor& shard) { opt.step_parameter(shard); });
  }
  torch::manual_seed(4);
  for (int step = 0; step < 20; ++step) {
    opt.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      fsdp.set_requires_gradient_sync(micro == 1);  // the first summed locally, as no_sync
      const auto tokens = torch::randint(61, {4, 17});
      torch::nn::functional::cross_entropy(fsdp.forward(tokens.slice(1, 0, 16)).reshape({-1, 61}),
                                           tokens.slice(1, 1, 17).reshape(-1))
          .backward();
    }
    if (clip) {
      fsdp.clip_grad_norm_(0.5);
    }
    opt.step();
    EXPECT_TRUE(opt.last_step_fused());
    if (step == 9 && !save_to.empty()) {
      save_sharded_checkpoint(save_to, fsdp, &opt);
    }
  }
  return {fsdp.full_state(), optimizer_state(opt)};
}

void expect_same_run(const FsdpRun& a, const FsdpRun& b, const std::string& what) {
  ASSERT_EQ(a.weights.size(), b.weights.size()) << what;
  for (const auto& [name, w] : a.weights) {
    EXPECT_TRUE(torch::equal(w, b.weights.at(name))) << what << ": " << name;
  }
  ASSERT_EQ(a.moments.size(), b.moments.size()) << what;
  for (const auto& [name, m] : a.moments) {
    EXPECT_TRUE(torch::equal(m, b.moments.at(name))) << what << ": " << name;
  }
}

dist::ProcessGroupPtr world_of_one() {
  return dist::init_process_group(
      dist::InitOptions()
          .backend("gloo")
          .init_method("file:///tmp/" + testing::unique_token("paratrain-offload-store"))
          .rank(0)
          .world_size(1));
}

TEST(Offload, FsdpOffloadIsBitwiseEqualToFsdpInMemory) {
  TempDir dir("offload-fsdp");
  const auto pg = world_of_one();
  const FsdpRun memory = fsdp_steps(pg, "memory", false, false);
  for (const std::string& tier : {dir.path(), std::string("host")}) {
    for (const auto& [gradients, params] : std::vector<std::pair<bool, bool>>{
             {false, false}, {true, false}, {false, true}, {true, true}}) {
      const std::string what = (tier == "host" ? "host" : "files") + std::string(" optimizer") +
                               (gradients ? "+gradients" : "") + (params ? "+params" : "");
      expect_same_run(fsdp_steps(pg, tier, gradients, params), memory, what);
    }
  }
}

// (Its first version found a race in the fused step, by a checksum: state loaded into memory was
// copied into a buffer whose last write was still in flight.)
TEST(Offload, FsdpCheckpointsMoveBetweenOffloadAndMemory) {
  TempDir dir("offload-fsdp-ckpt");
  const auto pg = world_of_one();
  const std::string offloaded = dir.path() + "/offloaded", in_memory = dir.path() + "/memory";
  const FsdpRun memory = fsdp_steps(pg, "memory", false, false, in_memory);
  fsdp_steps(pg, dir.path(), true, true, offloaded);
  // The second half of the run again, from either checkpoint, into the other kind.
  FsdpRun resumed = fsdp_steps(pg, "memory", false, false, "", offloaded);
  FsdpRun resumed_offloaded = fsdp_steps(pg, dir.path(), true, true, "", in_memory);
  const FsdpRun again = fsdp_steps(pg, "memory", false, false, "", in_memory);
  expect_same_run(resumed, again, "offloaded checkpoint, in memory");
  expect_same_run(resumed_offloaded, again, "in-memory checkpoint, offloaded");
  EXPECT_FALSE(torch::equal(again.weights.begin()->second, memory.weights.begin()->second))
      << "the resumed runs took 20 more steps";
}

// A GPT built with its weights deferred, each child initialised in order, is gpt()'s bit for bit;
// and FSDP that initialises each unit as it shards it (param_init_fn) holds the same weights.
TEST(Offload, DeferredGptIsGptsWeightsAndFsdpShardsItUnitByUnit) {
  const auto options = models::GptOptions().layers(3).width(32).heads(4).vocab(61).context(16);
  torch::manual_seed(7);
  auto whole = models::gpt(options);
  torch::manual_seed(7);
  auto deferred = models::gpt(models::GptOptions(options).defer_init(true));
  for (const auto& child : deferred->children()) {
    models::gpt_init_weights(*child);
  }
  const auto a = whole->named_parameters(), b = deferred->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].value(), b[i].value())) << a[i].key();
  }
  TempDir dir("offload-deferred");
  const auto pg = world_of_one();
  torch::manual_seed(7);
  auto lazy = models::gpt(models::GptOptions(options).defer_init(true));
  FullyShardedDataParallel fsdp(
      lazy, pg,
      FsdpOptions()
          .units(models::gpt_block_names(lazy))
          .param_init_fn(models::gpt_init_weights)
          .offload(FsdpOffloadPolicy()
                       .store(std::make_shared<OffloadStore>(OffloadOptions().dir(dir.path())))
                       .params(true)));
  for (const auto& [name, value] : fsdp.full_state()) {
    EXPECT_TRUE(torch::equal(value, whole->named_parameters()[name])) << name;
  }
}

// The optimizer in backward: each unit stepped from FSDP's gradient hook, its moments (and
// shards) streaming while backward goes on, ends bitwise where one step() after backward ends
// (without clipping, which needs every gradient first). From the second step on the next unit's
// blocks are read ahead, in the order the last step stepped them.
TEST(Offload, StepsInBackwardAreBitwiseEqualToOneStep) {
  TempDir dir("offload-in-backward");
  const auto pg = world_of_one();
  auto run = [&](const std::string& tier, bool params, bool in_backward) {
    return fsdp_steps(pg, tier, false, params, "", "", in_backward, /*clip=*/false);
  };
  const FsdpRun reference = run("memory", false, false);
  expect_same_run(run(dir.path(), false, true), reference, "files");
  expect_same_run(run(dir.path(), true, true), reference, "files, shards offloaded");
  expect_same_run(run("host", false, true), reference, "host");
}

}  // namespace
}  // namespace paratrain
