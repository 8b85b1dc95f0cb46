// Checkpoint files: optimizer state and RNG state round trips, atomic writes, the fallback to the
// previous checkpoint, and pruning.

#include "test_util.h"

#include "paratrain/io/checkpoint.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/models/registry.h"
#include "paratrain/train/trainer.h"  // make_optimizer, OptimizerOptions

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

torch::nn::Sequential seeded_model(const std::string& name) {
  torch::manual_seed(0);
  return models::make(name, 10);
}

// ---- checkpoints ------------------------------------------------------------------------------

TEST(Checkpoint, OptimizerStateRoundTripsBitwise) {
  for (const std::string kind : {"sgd", "adam", "adamw"}) {
    auto model = seeded_model("mlp");
    auto opt = make_optimizer(model->parameters(), OptimizerOptions().kind(kind).lr(0.01));
    auto step = [&](torch::optim::Optimizer& o, torch::nn::Sequential& m, int i) {
      torch::manual_seed(100 + i);
      o.zero_grad();
      m->forward(torch::randn({8, 1, 28, 28})).pow(2).mean().backward();
      o.step();
    };
    for (int i = 0; i < 3; ++i) {
      step(*opt, model, i);
    }
    const TensorMap saved_opt = clone_tensors(optimizer_state(*opt));
    const TensorMap saved_model = clone_tensors(module_state(*model));
    EXPECT_FALSE(saved_opt.empty()) << kind;
    step(*opt, model, 3);
    // A second model and optimizer restored from the copies take the same step.
    auto model2 = seeded_model("mlp");
    load_module_state(*model2, saved_model);
    auto opt2 = make_optimizer(model2->parameters(), OptimizerOptions().kind(kind).lr(0.01));
    load_optimizer_state(*opt2, saved_opt);
    step(*opt2, model2, 3);
    expect_bitwise(module_state(*model), module_state(*model2));
  }
}

TEST(Checkpoint, AtomicFilesFallbackAndPruning) {
  const std::string dir = make_temp_dir("ckpt");
  {
    Checkpoint ckpt(CheckpointOptions(dir).keep(3));
    for (int64_t step : {10, 20, 30, 40}) {
      CheckpointState s;
      s.step = step;
      s.meta = "{\"step\": " + std::to_string(step) + "}";
      s.shared["w"] = torch::full({4}, static_cast<float>(step));
      s.own = rng_state();
      ckpt.save(std::move(s));
    }
    ckpt.wait();
    EXPECT_EQ(ckpt.steps(), (std::vector<int64_t>{40, 30, 20}));  // keep 3
  }
  // No temporary file is left, and the oldest checkpoint's files are gone.
  auto r = run_process({"/bin/ls", dir}, {}, 10);
  EXPECT_NE(r.output.find("ckpt-0000000040.json"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(".tmp-"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("ckpt-0000000010"), std::string::npos) << r.output;

  // Truncate the newest: resume falls back to the one before, with a warning naming the file.
  const std::string newest = dir + "/ckpt-0000000040.safetensors";
  ASSERT_EQ(::truncate(newest.c_str(), 20), 0);
  // Flip a byte in the next: its CRC-32 fails.
  {
    std::fstream f(dir + "/ckpt-0000000030.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x55');
  }
  Checkpoint ckpt(CheckpointOptions(dir).keep(3));
  std::vector<std::string> warnings;
  auto s = ckpt.load_latest([&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->step, 20);
  EXPECT_TRUE(torch::equal(s->shared.at("w"), torch::full({4}, 20.0f)));
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("ckpt-0000000040.safetensors has 20 bytes"), std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[1].find("ckpt-0000000030.safetensors fails its CRC-32 check"),
            std::string::npos)
      << warnings[1];
  remove_tree(dir);

  EXPECT_NE(error_of([] {
              Checkpoint c(CheckpointOptions("/proc/paratrain-ckpt"));
            }).find("cannot create the checkpoint directory /proc/paratrain-ckpt"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Checkpoint c(CheckpointOptions("/tmp").keep(0));
            }).find("the number of checkpoints to keep must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Checkpoint::load("/nonexistent/ckpt-0000000001.json");
            }).find("does not exist"),
            std::string::npos);
}

// Each rank's manifest lives in its tensor file's header (one file, so one fsync, per rank): a
// damaged rank file fails its checks as a damaged shared file does, and a checkpoint written with
// the separate rank manifest of earlier versions still loads.
TEST(Checkpoint, RankFilesCarryTheirManifestInTheirHeader) {
  const std::string dir = make_temp_dir("ckpt-rank");
  const std::string base = dir + "/ckpt-00000000";
  {
    Checkpoint ckpt(CheckpointOptions(dir).keep(3).background(false));
    for (int64_t step : {10, 20, 30}) {
      CheckpointState s;
      s.step = step;
      s.shared["w"] = torch::full({4}, static_cast<float>(step));
      s.own["r"] = torch::arange(64, torch::kFloat) + static_cast<float>(step);
      ckpt.save(std::move(s));
    }
  }
  auto listing = run_process({"/bin/ls", dir}, {}, 10).output;
  EXPECT_EQ(
      listing,
      "ckpt-0000000010.json\nckpt-0000000010.rank-0.safetensors\nckpt-0000000010.safetensors\n"
      "ckpt-0000000020.json\nckpt-0000000020.rank-0.safetensors\nckpt-0000000020.safetensors\n"
      "ckpt-0000000030.json\nckpt-0000000030.rank-0.safetensors\nckpt-0000000030.safetensors\n");
  const auto meta = load_safetensors_metadata(base + "30.rank-0.safetensors");
  EXPECT_EQ(meta.at("step"), "30");
  EXPECT_EQ(meta.at("rank"), "0");
  EXPECT_EQ(meta.at("world_size"), "1");
  EXPECT_EQ(meta.at("data_bytes"), "256");
  // Step 30: a flipped byte in the rank file's data. Step 20: the rank file cut short.
  {
    std::fstream f(base + "30.rank-0.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x55');
  }
  struct stat st {};
  ASSERT_EQ(::stat((base + "20.rank-0.safetensors").c_str(), &st), 0);
  ASSERT_EQ(::truncate((base + "20.rank-0.safetensors").c_str(), st.st_size - 4), 0);
  // Step 10 as an earlier version wrote it: a rank file without the header's fields, and its
  // manifest beside it.
  const TensorMap own10{{"r", torch::arange(64, torch::kFloat) + 10.0f}};
  save_safetensors(own10, base + "10.rank-0.safetensors");
  std::ifstream in10(base + "10.rank-0.safetensors", std::ios::binary);
  const std::string bytes10((std::istreambuf_iterator<char>(in10)),
                            std::istreambuf_iterator<char>());
  const auto crc10 = crc32_of({{bytes10.data(), bytes10.size()}});
  std::ofstream(base + "10.rank-0.json")
      << "{\"step\": 10, \"rank\": 0, \"world_size\": 1, \"tensors\": {\"file\": "
         "\"ckpt-0000000010.rank-0.safetensors\", \"bytes\": "
      << bytes10.size() << ", \"crc32\": " << crc10 << "}}\n";

  Checkpoint ckpt(CheckpointOptions(dir).keep(3));
  std::vector<std::string> warnings;
  auto s = ckpt.load_latest([&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->step, 10);
  EXPECT_TRUE(torch::equal(s->own.at("r"), own10.at("r")));
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("ckpt-0000000030.rank-0.safetensors fails its CRC-32 check"),
            std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[1].find("ckpt-0000000020.rank-0.safetensors"), std::string::npos)
      << warnings[1];
  EXPECT_NE(error_of([&] {
              Checkpoint::load_own(base + "30.json", 1, 30);
            }).find("ckpt-0000000030.rank-1.safetensors"),
            std::string::npos);
  remove_tree(dir);
}

void save_step(Checkpoint& ckpt, int64_t step) {
  CheckpointState s;
  s.step = step;
  s.shared["w"] = torch::full({4}, static_cast<float>(step));
  s.own["r"] = torch::arange(16, torch::kFloat) + static_cast<float>(step);
  ckpt.save(std::move(s));
}

void flip_last_byte(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-1, std::ios::end);
  const char c = static_cast<char>(f.get());
  f.seekp(-1, std::ios::end);
  f.put(static_cast<char>(c ^ 0x55));
}

// No checkpoint at all is a start from step 0; checkpoints that all fail their checks are not:
// load_latest fails, naming the newest one's fault, and nothing is deleted. A fresh start beside
// them is an explicit choice, after which rotation still deletes none of them.
TEST(Checkpoint, EveryCheckpointDamagedFailsAndDeletesNothing) {
  const std::string dir = make_temp_dir("ckpt-damaged");
  {
    Checkpoint empty{CheckpointOptions(dir)};
    EXPECT_FALSE(empty.load_latest().has_value());  // nothing there yet
    Checkpoint ckpt(CheckpointOptions(dir).keep(3).background(false));
    save_step(ckpt, 10);
    save_step(ckpt, 20);
  }
  // Step 20's shared file cut short; step 10's rank file with a changed byte (its shared file and
  // manifest intact).
  ASSERT_EQ(::truncate((dir + "/ckpt-0000000020.safetensors").c_str(), 20), 0);
  flip_last_byte(dir + "/ckpt-0000000010.rank-0.safetensors");
  const auto damaged = files_in(dir);
  ASSERT_EQ(damaged.size(), 6u);

  Checkpoint ckpt(CheckpointOptions(dir).keep(2).background(false));
  std::vector<std::string> warnings;
  const std::string e =
      error_of([&] { ckpt.load_latest([&](const std::string& w) { warnings.push_back(w); }); });
  EXPECT_NE(e.find("every checkpoint in '" + dir +
                   "' is damaged (2 of them; the newest, ckpt-0000000020: " + dir +
                   "/ckpt-0000000020.safetensors has 20 bytes, its manifest says "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("): none was loaded and none deleted; move them out of the directory, or set "
                   "start_fresh_if_damaged to start from step 0 with them left in place"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[1].find("ckpt-0000000010.rank-0.safetensors fails its CRC-32 check"),
            std::string::npos)
      << warnings[1];
  EXPECT_EQ(files_in(dir), damaged);

  // Chosen: a start from step 0 beside them. This run's checkpoints rotate among themselves.
  Checkpoint fresh(CheckpointOptions(dir).keep(2).background(false).start_fresh_if_damaged(true));
  EXPECT_FALSE(fresh.load_latest([](const std::string&) {}).has_value());
  for (int64_t step : {5, 15, 25}) {
    save_step(fresh, step);
  }
  EXPECT_EQ(fresh.steps(), (std::vector<int64_t>{25, 20, 15, 10}));
  const auto now = files_in(dir);
  for (const auto& [name, bytes] : damaged) {
    ASSERT_TRUE(now.count(name)) << name << " was deleted";
    EXPECT_TRUE(now.at(name) == bytes) << name << " changed";
  }
  remove_tree(dir);
}

// Rotation deletes every file of a pruned checkpoint, the rank files of a larger world that wrote
// it included (an elastic job that shrank from 2 ranks to 1), and the files of an unfinished save
// once the run is past its step; never a file of a kept checkpoint, nor a checkpoint newer than
// the one resumed (here one skipped as damaged).
TEST(Checkpoint, RotationPrunesEveryRanksFilesAndKeepsNewerCheckpoints) {
  const std::string dir = make_temp_dir("ckpt-rotation");
  const std::string base = dir + "/ckpt-00000000";
  {
    Checkpoint ckpt(CheckpointOptions(dir).keep(3).background(false));
    for (int64_t step : {4, 8, 12}) {
      save_step(ckpt, step);
    }
  }
  // Rank 1's files of a job of 2 ranks, beside rank 0's (rotation goes by their names).
  for (const char* step : {"04", "08", "12"}) {
    std::filesystem::copy_file(base + step + ".rank-0.safetensors",
                               base + step + ".rank-1.safetensors");
  }
  ASSERT_EQ(::truncate((base + "12.safetensors").c_str(), 20), 0);  // the newest is damaged
  // And rank 1's file of a save of step 11 that did not finish (no manifest: no checkpoint).
  std::filesystem::copy_file(base + "08.rank-0.safetensors", base + "11.rank-1.safetensors");
  const auto twelve = files_in(dir);

  Checkpoint ckpt(CheckpointOptions(dir).keep(2).background(false));
  auto s = ckpt.load_latest([](const std::string&) {});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->step, 8);
  auto has = [&](const std::string& name) { return files_in(dir).count(name) != 0; };
  // Which of a step's manifest, shared file, rank 0's and rank 1's files are there: "1111".
  auto step_files = [&](const std::string& step) {
    std::string out;
    for (const char* suffix :
         {".json", ".safetensors", ".rank-0.safetensors", ".rank-1.safetensors"}) {
      out += has("ckpt-00000000" + step + suffix) ? "1" : "0";
    }
    return out;
  };
  const std::string all = "1111";
  const std::string none = "0000";
  save_step(ckpt, 9);  // keeps 9 and 8; 12, newer than the one resumed, stays
  EXPECT_EQ(step_files("04"), none);
  EXPECT_EQ(step_files("08"), all);
  EXPECT_EQ(step_files("12"), all);
  save_step(ckpt, 10);
  EXPECT_EQ(step_files("08"), none);  // rank 1's file too
  EXPECT_EQ(step_files("12"), all);
  EXPECT_EQ(step_files("11"), "0001");
  EXPECT_EQ(ckpt.steps(), (std::vector<int64_t>{12, 10, 9}));
  for (const char* name : {"ckpt-0000000012.json", "ckpt-0000000012.safetensors",
                           "ckpt-0000000012.rank-1.safetensors"}) {
    EXPECT_TRUE(files_in(dir).at(name) == twelve.at(name)) << name;
  }
  // A save at step 12 replaces the damaged one; its old rank-1 file stays with it while it is
  // kept, and goes with it.
  save_step(ckpt, 12);
  EXPECT_EQ(ckpt.steps(), (std::vector<int64_t>{12, 10}));
  EXPECT_EQ(step_files("12"), all);
  EXPECT_EQ(step_files("11"), none);  // passed: the unfinished save's file goes
  save_step(ckpt, 13);
  save_step(ckpt, 14);
  EXPECT_EQ(step_files("12"), none);
  EXPECT_EQ(ckpt.steps(), (std::vector<int64_t>{14, 13}));
  EXPECT_EQ(files_in(dir).size(), 6u);  // 13 and 14: a manifest, a shared file, a rank file each
  remove_tree(dir);
}

TEST(Checkpoint, FileNamesGiveTheirStep) {
  EXPECT_EQ(Checkpoint::file_step("ckpt-0000000012.json"), 12);
  EXPECT_EQ(Checkpoint::file_step("ckpt-0000000012.safetensors"), 12);
  EXPECT_EQ(Checkpoint::file_step("ckpt-0000000012.rank-3.safetensors"), 12);
  EXPECT_EQ(Checkpoint::file_step("ckpt-0000000012.rank-3.json"), 12);  // earlier versions'
  EXPECT_EQ(Checkpoint::file_step(Checkpoint::rank_file_name(7, 1)), 7);
  for (const char* other : {"ckpt-0000000012.json.tmp-41", "ckpt-12.json", "fsdp.json",
                            "rank-0-of-2.safetensors", "ckpt-0000000012.rank-.safetensors"}) {
    EXPECT_EQ(Checkpoint::file_step(other), -1) << other;
    EXPECT_FALSE(Checkpoint::is_checkpoint_file(other)) << other;
  }
}

TEST(Checkpoint, RngStateRestoresTheSameDraws) {
  torch::manual_seed(7);
  torch::randn({3});
  const TensorMap state = rng_state();
  const torch::Tensor a = torch::randn({5});
  torch::randn({11});
  set_rng_state(state);
  EXPECT_TRUE(torch::equal(a, torch::randn({5})));
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
