// Hugging Face GPT-2 against transformers itself (tests/models/hf_gpt2_reference.py, run by the
// Python of PARATRAIN_HF_PYTHON, scripts/venv.sh's): models that GPT2LMHeadModel made from a
// GPT2Config with random weights (nothing downloaded) and saved whole and in shards load into
// paratrain with their logits, and generate greedily token for token as transformers' generate();
// a GPT-2 fine-tuned with `paratrain train --strategy fsdp` and exported with `paratrain checkpoint
// consolidate --names hf`, whole and in shards, loads with from_pretrained with paratrain's logits.
// Without that Python the tests skip, saying how to make it.

#include "test_util.h"

#include "paratrain/data/tokens.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/io/safetensors_shards.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/gpt_pretrained.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

const std::map<std::string, std::string> kOffline{{"HF_HUB_OFFLINE", "1"},
                                                  {"TRANSFORMERS_OFFLINE", "1"}};

std::string hf_reference_script() {
  return std::string(PARATRAIN_TEST_DATA_DIR) + "/../models/hf_gpt2_reference.py";
}

// The models transformers made (hf_gpt2_reference.py make), once per test process: importing
// transformers and making gpt2's 50257 x 768 embedding take seconds. Removed at exit.
struct HfReference {
  std::string dir;
  ProcessResult made;
  HfReference() : dir(make_temp_dir("hf-gpt2")) {
    made = run_process({hf_python(), hf_reference_script(), "make", dir}, kOffline, 300);
  }
  ~HfReference() { remove_tree(dir); }
};
const HfReference& hf_reference() {
  static const HfReference reference;
  return reference;
}

// Skips the test without a Python with transformers; fails it when the reference could not be
// made.
#define PARATRAIN_NEED_HF_REFERENCE()    \
  if (!hf_python_missing().empty()) {    \
    GTEST_SKIP() << hf_python_missing(); \
  }                                      \
  ASSERT_EQ(hf_reference().made.exit_code, 0) << hf_reference().made.output

// The names of the models the reference makes, and their generations.
const char* const kHfModels[] = {"gpt2-2l", "small"};

torch::Tensor paratrain_logits(const std::string& dir, const torch::Tensor& tokens) {
  auto model = models::gpt(models::gpt2_config_options(dir));
  models::load_gpt2_safetensors(model, dir);
  model->eval();
  torch::NoGradGuard no_grad;
  return model->forward(tokens);
}

TEST(HfGpt2, LogitsEqualTransformersWholeAndSharded) {
  PARATRAIN_NEED_HF_REFERENCE();
  const auto reference = load_safetensors(hf_reference().dir + "/reference.safetensors");
  for (const std::string name : kHfModels) {
    const std::string whole = hf_reference().dir + "/" + name;
    const std::string sharded = whole + "-sharded";
    // save_pretrained wrote what each case is about: one file, or shards and their index.
    EXPECT_EQ(files_in(whole).count(kSafetensorsWeightsFile), 1u) << whole;
    EXPECT_EQ(files_in(sharded).count(kSafetensorsWeightsFile), 0u) << sharded;
    ASSERT_EQ(files_in(sharded).count(kSafetensorsIndexFile), 1u) << sharded;
    const torch::Tensor tokens = reference.at(name + ".tokens");
    const torch::Tensor expected = reference.at(name + ".logits");
    for (const std::string& dir : {whole, sharded}) {
      const torch::Tensor logits = paratrain_logits(dir, tokens);
      ASSERT_EQ(logits.sizes(), expected.sizes()) << dir;
      // Both run fp32, the same operations in another order and other kernels (transformers'
      // SDPA attention and its own GELU, another PyTorch): 2.4e-6 apart here for gpt2's shape
      // (largest logit about 3), 4e-7 for the small one. 1e-5 leaves room for other CPUs' kernels.
      const double diff = (logits - expected).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << dir << ": largest logit " << expected.abs().max().item<double>();
    }
  }
}

TEST(HfGpt2, GreedyGenerationEqualsTransformers) {
  PARATRAIN_NEED_HF_REFERENCE();
  const auto generations = nlohmann::json::parse(file_bytes(hf_reference().dir + "/generate.json"));
  for (const std::string name : kHfModels) {
    const auto& g = generations.at(name);
    std::string prompt;
    for (const auto& id : g.at("prompt")) {
      prompt += (prompt.empty() ? "" : ",") + std::to_string(id.get<int64_t>());
    }
    std::string expected;
    for (const auto& id : g.at("greedy")) {
      expected += (expected.empty() ? "" : ",") + std::to_string(id.get<int64_t>());
    }
    // The sharded copy, through the command line: config.json's shape, the index's shards.
    const auto r =
        run_process({cli_path(), "generate", "--model", "gpt2", "--load-weights",
                     hf_reference().dir + "/" + name + "-sharded", "--tokens", prompt,
                     "--max-new-tokens", std::to_string(g.at("max_new_tokens").get<int64_t>())},
                    {kCpuOnly}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output, expected + "\n") << name;
  }
}

// Token files of random ids below `vocab`, as paratrain train --dataset tokens reads them.
void write_token_files(const std::string& dir, int64_t vocab) {
  torch::manual_seed(11);
  data::write_tokens(dir + "/train.bin", torch::randint(0, vocab, {4000}));
  data::write_tokens(dir + "/val.bin", torch::randint(0, vocab, {400}));
}

TEST(HfGpt2, FsdpFineTuneExportsWhatTransformersLoads) {
  PARATRAIN_NEED_HF_REFERENCE();
  const std::string dir = make_temp_dir("hf-export");
  const std::string start = hf_reference().dir + "/small";
  write_token_files(dir, models::gpt2_config_options(start).vocab());
  // The recipe of docs/hugging-face.md: weights in, FSDP (a world of one here), a context
  // shortened from config.json's 48 to 32, two steps of AdamW.
  auto r = run_process(
      {cli_path(),         "train",      "--model",     "gpt2",  "--load-weights", start,
       "--dataset",        "tokens",     "--data-dir",  dir,     "--strategy",     "fsdp",
       "--context",        "32",         "--epochs",    "1",     "--steps",        "2",
       "--batch-size",     "4",          "--optimizer", "adamw", "--lr",           "1e-2",
       "--checkpoint-dir", dir + "/ckpt"},
      {kCpuOnly}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string ckpt = dir + "/ckpt";
  r = run_cli({cli_path(), "checkpoint", "consolidate", ckpt, "--out", dir + "/own.safetensors"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli(
      {cli_path(), "checkpoint", "consolidate", ckpt, "--names", "hf", "--out", dir + "/whole"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli({cli_path(), "checkpoint", "consolidate", ckpt, "--names", "hf", "--out",
               dir + "/sharded", "--max-shard-size", "100KB"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(files_in(dir + "/sharded").count(kSafetensorsIndexFile), 1u);
  EXPECT_GT(files_in(dir + "/sharded").size(), 3u) << "config.json, the index, shards";

  // paratrain's logits: the fine-tuned weights by the model's own names, in config.json's shape.
  const models::GptOptions shape = models::gpt2_config_options(dir + "/whole");
  EXPECT_EQ(shape.context(), 32);
  EXPECT_EQ(shape.heads(), 3);
  auto model = models::gpt(shape);
  load_module_state(*model, load_safetensors(dir + "/own.safetensors"));
  model->eval();
  torch::manual_seed(12);
  const torch::Tensor tokens = torch::randint(0, shape.vocab(), {2, 32});
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->forward(tokens);
  }
  // Fine-tuning moved them from the starting model's.
  EXPECT_GT((logits - paratrain_logits(start, tokens)).abs().max().item<double>(), 1e-3);

  save_safetensors({{"tokens", tokens}}, dir + "/tokens.safetensors");
  r = run_process({hf_python(), hf_reference_script(), "logits", dir + "/tokens.safetensors",
                   dir + "/hf.safetensors", dir + "/whole", dir + "/sharded"},
                  kOffline, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto hf = load_safetensors(dir + "/hf.safetensors");
  for (const char* key : {"logits.0", "logits.1"}) {  // 5e-7 apart here
    ASSERT_EQ(hf.at(key).sizes(), logits.sizes());
    EXPECT_LE((hf.at(key) - logits).abs().max().item<double>(), 1e-5) << key;
  }
  remove_tree(dir);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
