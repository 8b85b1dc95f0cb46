// Hugging Face model directories of GPT-2 without transformers (models/gpt_pretrained.h,
// io/safetensors_shards.h, models/generate.h): save and load round trips, whole and sharded;
// huggingface_hub's shard plan; a shorter context; generation; and the bad inputs of
// `paratrain generate` and `paratrain checkpoint consolidate --names hf`, each one line.
// tests/models/hf_gpt2_test.cpp compares the same with transformers itself.

#include "test_util.h"

#include "paratrain/comm/init.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/io/safetensors_shards.h"
#include "paratrain/models/generate.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/gpt_pretrained.h"
#include "paratrain/parallel/fsdp_checkpoint.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

models::GptOptions pretrained_small() {
  return models::GptOptions().layers(2).width(48).heads(3).vocab(61).context(24);
}

// A small GPT whose every tensor is far from its initial value (LayerNorms included), so that a
// tensor that is not loaded, or loaded into another's place, shows.
torch::nn::Sequential spread_gpt(const models::GptOptions& o, int seed) {
  torch::manual_seed(seed);
  auto model = models::gpt(o);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    p.normal_(0, 0.3);
  }
  return model;
}

std::map<std::string, torch::Tensor> named(const torch::nn::Sequential& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : model->named_parameters()) {
    out[p.key()] = p.value();
  }
  return out;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// The exit code is not 0, and the output is one line containing each of `needles`.
void expect_one_line_error(const ProcessResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  std::string line = r.output;
  while (!line.empty() && line.back() == '\n') {
    line.pop_back();
  }
  EXPECT_EQ(line.find('\n'), std::string::npos) << r.output;
  for (const auto& needle : needles) {
    EXPECT_NE(line.find(needle), std::string::npos) << "'" << needle << "' in: " << r.output;
  }
}

TEST(GptPretrained, SaveAndLoadRoundTripBitwiseWholeAndSharded) {
  const std::string dir = make_temp_dir("gpt-pretrained");
  auto saved = spread_gpt(pretrained_small(), 1);
  models::save_gpt2_pretrained(dir + "/whole", saved);
  // Shards of at most 20 KB: wte (61 x 48 floats, 11.7 KB) and the block tensors share some;
  // c_fc (48 x 192 floats, 36.9 KB) is larger than a shard and has one of its own.
  const int64_t max_shard = 20000;
  models::save_gpt2_pretrained(dir + "/sharded", saved, max_shard);
  EXPECT_EQ(files_in(dir + "/whole").size(), 2u);  // config.json, model.safetensors
  const auto index = nlohmann::json::parse(file_bytes(dir + "/sharded/" + kSafetensorsIndexFile));
  std::map<std::string, torch::Tensor> hf;
  for (const auto& kv : named(saved)) {
    hf[models::hf_gpt2_name(kv.first)] = kv.second;
  }
  const auto plan = plan_safetensors_shards(hf, max_shard);
  ASSERT_GT(plan.size(), 2u);
  const auto files = files_in(dir + "/sharded");
  EXPECT_EQ(files.size(), plan.size() + 2) << "shards, the index and config.json";
  EXPECT_EQ(files.count(kSafetensorsWeightsFile), 0u);
  int64_t total = 0;
  for (const auto& shard : plan) {
    int64_t bytes = 0;
    for (const auto& name : shard) {
      bytes += static_cast<int64_t>(hf.at(name).nbytes());
      EXPECT_EQ(index["weight_map"][name], index["weight_map"][shard.front()]) << name;
    }
    // huggingface_hub's rule: within the limit, or one tensor larger than it alone.
    EXPECT_TRUE(bytes <= max_shard || shard.size() == 1) << bytes;
    total += bytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
  EXPECT_EQ(index["weight_map"].size(), hf.size());
  for (const char* sub : {"/whole", "/sharded"}) {
    const models::GptOptions o = models::gpt2_config_options(dir + sub);
    EXPECT_EQ(o.layers(), 2);
    EXPECT_EQ(o.heads(), 3);
    EXPECT_EQ(o.width(), 48);
    EXPECT_EQ(o.context(), 24);
    EXPECT_EQ(o.vocab(), 61);
    auto loaded = spread_gpt(o, 2);
    ASSERT_FALSE(torch::equal(named(loaded).at("h1.ln_2.bias"), named(saved).at("h1.ln_2.bias")));
    models::load_gpt2_safetensors(loaded, dir + sub);
    expect_bitwise(named(saved), named(loaded));
  }
  remove_tree(dir);
}

TEST(GptPretrained, ShorterContextKeepsTheFirstPositions) {
  const std::string dir = make_temp_dir("gpt-crop");
  auto full = spread_gpt(pretrained_small(), 3);
  models::save_gpt2_pretrained(dir + "/m", full);
  auto cropped = spread_gpt(models::gpt2_config_options(dir + "/m").context(10), 4);
  models::load_gpt2_safetensors(cropped, dir + "/m");
  EXPECT_TRUE(torch::equal(named(cropped).at("embed.wpe.weight"),
                           named(full).at("embed.wpe.weight").narrow(0, 0, 10)));
  full->eval();
  cropped->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor tokens = torch::randint(0, 61, {2, 10});
  EXPECT_TRUE(torch::equal(full->forward(tokens), cropped->forward(tokens)));
  // A longer context than config.json's n_positions has no weights to take.
  auto longer = models::gpt(models::gpt2_config_options(dir + "/m").context(30));
  const std::string e = error_of([&] { models::load_gpt2_safetensors(longer, dir + "/m"); });
  EXPECT_NE(
      e.find("the model's context 30 is longer than " + dir + "/m/config.json's n_positions 24"),
      std::string::npos)
      << e;
  remove_tree(dir);
}

TEST(GptPretrained, GenerationIsGreedyOrSampledFromTheTopK) {
  auto model = spread_gpt(pretrained_small(), 5);
  model->train();  // generate() runs in eval mode, and leaves the model as it was
  const std::vector<int64_t> prompt{3, 14, 15};
  const auto greedy = models::generate(model, prompt, models::GenerateOptions().max_new_tokens(12));
  ASSERT_EQ(greedy.size(), 15u);
  const auto top3 = models::GenerateOptions().max_new_tokens(12).sample(true).top_k(3).seed(7);
  const auto sampled = models::generate(model, prompt, top3);
  EXPECT_EQ(models::generate(model, prompt, top3), sampled) << "the same seed, the same draws";
  torch::NoGradGuard no_grad;
  for (size_t i = prompt.size(); i < greedy.size(); ++i) {
    const auto step = [&](const std::vector<int64_t>& so_far) {
      const std::vector<int64_t> before(so_far.begin(), so_far.begin() + static_cast<long>(i));
      return model->forward(torch::tensor(before).view({1, -1}))[0][-1];
    };
    EXPECT_EQ(greedy[i], step(greedy).argmax().item<int64_t>()) << "token " << i;
    const torch::Tensor best3 = std::get<1>(step(sampled).topk(3));
    EXPECT_TRUE((best3 == sampled[i]).any().item<bool>()) << "token " << i << ": " << sampled[i];
  }
  // Ending at a token: right after its first generation, which is kept.
  const int64_t eos = greedy[4];
  const auto first =
      std::find(greedy.begin() + static_cast<long>(prompt.size()), greedy.end(), eos);
  const auto stops = models::generate(
      model, prompt, models::GenerateOptions().max_new_tokens(12).eos_token_ids({eos}));
  EXPECT_EQ(stops, std::vector<int64_t>(greedy.begin(), first + 1));
  EXPECT_TRUE(model->is_training());
}

// A directory saved by paratrain, for the command lines below.
std::string saved_model_dir(const std::string& dir,
                            int64_t max_shard = models::kHfDefaultMaxShardBytes) {
  models::save_gpt2_pretrained(dir, spread_gpt(pretrained_small(), 6), max_shard);
  return dir;
}

TEST(GptPretrained, ConfigThatDoesNotMatchTheWeightsIsOneLine) {
  torch::manual_seed(0);
  const std::string base = make_temp_dir("gpt-config");
  const std::string dir = saved_model_dir(base + "/m");
  auto config = nlohmann::json::parse(file_bytes(dir + "/config.json"));
  config["n_embd"] = 36;  // 3 heads of 12 instead of 16
  write_text(dir + "/config.json", config.dump(2));
  auto r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,2"});
  expect_one_line_error(
      r, {dir + "/config.json does not match the weights beside it",
          "tensor 'transformer.wte.weight' has shape [61, 48] in " + dir + "/model.safetensors",
          "but config.json (n_layer 2, n_embd 36, n_head 3, n_positions 24, "
          "vocab_size 61) makes it [61, 36]"});
  r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,2", "--layers", "3"});
  expect_one_line_error(r, {"--layers shapes a GPT built from scratch", "drop --layers"});
  config["n_embd"] = 48;
  config["activation_function"] = "relu";
  write_text(dir + "/config.json", config.dump(2));
  EXPECT_NE(error_of([&] { models::gpt2_config_options(dir); })
                .find("sets activation_function to 'relu', but paratrain's GPT-2 uses GPT-2's "
                      "gelu_new"),
            std::string::npos);
  config["activation_function"] = "gelu_new";
  config["model_type"] = "llama";
  write_text(dir + "/config.json", config.dump(2));
  EXPECT_NE(error_of([&] {
              models::gpt2_config_options(dir);
            }).find("is the config of a 'llama' model, not of GPT-2"),
            std::string::npos);
  config["model_type"] = "gpt2";
  config["attn_pdrop"] = 0.2;  // paratrain applies one rate: resid_pdrop's
  write_text(dir + "/config.json", config.dump(2));
  EXPECT_NE(error_of([&] { models::gpt2_config_options(dir); })
                .find("sets attn_pdrop to 0.2 and resid_pdrop to 0, but paratrain's GPT-2 "
                      "applies one dropout rate"),
            std::string::npos);
  remove_tree(base);
}

// A save into a directory that holds weights would mix two models (the same tensor names load
// from either), or leave files a loader prefers: refused, and nothing is written.
TEST(GptPretrained, ShardsAreNeverWrittenOverAnotherSave) {
  const std::string base = make_temp_dir("gpt-shards-over");
  const std::map<std::string, torch::Tensor> tensors{{"a", torch::zeros({64})},
                                                     {"b", torch::ones({64})}};
  save_safetensors_shards(base + "/m", tensors, 300);  // two shards and the index
  const auto before = files_in(base + "/m");
  for (const int64_t max_bytes : {int64_t{300}, int64_t{1} << 20}) {  // sharded, then whole
    const std::string e =
        error_of([&] { save_safetensors_shards(base + "/m", tensors, max_bytes); });
    EXPECT_NE(e.find(base + "/m already holds model weights ("), std::string::npos) << e;
    EXPECT_EQ(files_in(base + "/m"), before);
  }
  remove_tree(base);
}

TEST(GptPretrained, IndexNamingAMissingShardIsOneLine) {
  torch::manual_seed(0);
  const std::string base = make_temp_dir("gpt-shards");
  const std::string dir = saved_model_dir(base + "/m", 20000);
  const auto index = nlohmann::json::parse(file_bytes(dir + "/" + kSafetensorsIndexFile));
  std::string shard, tensor;
  for (const auto& item : index["weight_map"].items()) {
    if (item.value().get<std::string>().rfind("model-00002-of-", 0) == 0) {
      shard = item.value().get<std::string>();
      tensor = tensor.empty() ? item.key() : tensor;
    }
  }
  ASSERT_FALSE(shard.empty());
  ASSERT_EQ(std::remove((dir + "/" + shard).c_str()), 0);
  const auto r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,2"});
  expect_one_line_error(r, {"the index " + dir + "/" + kSafetensorsIndexFile + " names the shard " +
                                shard + " (holding '" + tensor + "'), which is missing from " + dir,
                            "copy every file the index lists"});
  remove_tree(base);
}

TEST(GptPretrained, GenerateRefusesTokensOutsideTheVocabularyAndTooManyNewTokens) {
  torch::manual_seed(0);
  const std::string base = make_temp_dir("gpt-generate");
  const std::string dir = saved_model_dir(base + "/m");
  auto r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,61,2"});
  expect_one_line_error(r, {"token 61 (number 2 of the prompt) is outside the model's vocabulary "
                            "of 61 tokens: ids go from 0 to 60"});
  r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,2,3",
               "--max-new-tokens", "22"});
  expect_one_line_error(r,
                        {"3 prompt tokens and 22 new ones make 25, more than the model's "
                         "context of 24 positions: at most 21 new tokens fit after this prompt"});
  r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,x"});
  expect_one_line_error(r, {"--tokens: 'x' is not a token id"});
  EXPECT_EQ(r.exit_code, 2);  // a usage error
  r = run_cli({cli_path(), "generate", "--load-weights", dir, "--tokens", "1,2,3",
               "--max-new-tokens", "21", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto row = nlohmann::json::parse(r.output);
  EXPECT_EQ(row["tokens"].size(), 24u);
  EXPECT_EQ(row["new_tokens"].size(), 21u);
  remove_tree(base);
}

dist::ProcessGroupPtr pretrained_world_of_one() {
  const std::string path = "/tmp/" + unique_token("paratrain-pretrained-store");
  return dist::init_process_group(
      dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
}

TEST(GptPretrained, ExportRefusesADirectoryHoldingAModel) {
  const std::string dir = make_temp_dir("gpt-export");
  auto pg = pretrained_world_of_one();
  auto trained = spread_gpt(pretrained_small(), 8);
  const auto expected = clone_tensors(named(trained));
  FullyShardedDataParallel fsdp(trained, pg);
  save_sharded_checkpoint(dir + "/ckpt", fsdp, nullptr);
  auto consolidate = [&](const std::string& out, const std::vector<std::string>& more) {
    std::vector<std::string> argv{cli_path(), "checkpoint", "consolidate", dir + "/ckpt",
                                  "--names",  "hf",         "--out",       out};
    argv.insert(argv.end(), more.begin(), more.end());
    return run_cli(argv);
  };
  // A checkpoint save_sharded_checkpoint wrote does not record the heads.
  const std::string out = dir + "/hf";
  auto r = consolidate(out, {});
  expect_one_line_error(r, {"does not record the model's attention heads", "give --heads H"});
  EXPECT_FALSE(std::ifstream(out + "/config.json").good());
  ASSERT_EQ(::mkdir(out.c_str(), 0755), 0);
  write_text(out + "/tokenizer.json", "{}");  // a tokenizer's files are no model's
  r = consolidate(out, {"--heads", "3", "--max-shard-size", "20KB"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(file_bytes(out + "/tokenizer.json"), "{}");
  auto loaded = spread_gpt(models::gpt2_config_options(out), 9);
  models::load_gpt2_safetensors(loaded, out);
  expect_bitwise(expected, named(loaded));
  // Again into the same directory, or into another model's: refused, nothing changed.
  const std::string other = saved_model_dir(dir + "/other");
  for (const std::string& to : {out, other}) {
    const auto before = files_in(to);
    r = consolidate(to, {"--heads", "3"});
    expect_one_line_error(r, {to + " already holds a model's files (config.json, ",
                              "nothing was written: give a new or empty directory"});
    EXPECT_EQ(files_in(to), before);
  }
  r = consolidate(dir + "/x", {"--heads", "3", "--max-shard-size", "5XB"});
  expect_one_line_error(r, {"--max-shard-size '5XB' is not a shard size"});
  // --out FILE.safetensors with --names hf stays one safetensors file, as before.
  r = consolidate(dir + "/one.safetensors", {});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(load_safetensors(dir + "/one.safetensors").count("transformer.wte.weight"), 1u);
  remove_tree(dir);
}

TEST(GptPretrained, ShardSizesAreSavePretrainedsAndBadOnesOneLine) {
  EXPECT_EQ(parse_shard_size("500KB"), 500000);
  EXPECT_EQ(parse_shard_size("5GB"), 5000000000);
  EXPECT_EQ(parse_shard_size("1.5MB"), 1500000);
  EXPECT_EQ(parse_shard_size("4MiB"), 4 << 20);
  EXPECT_EQ(parse_shard_size("4096"), 4096);
  for (const char* bad : {"", "5XB", "0", "KB", "1.2.3MB", "-5MB", "0.1B"}) {
    const std::string e = error_of([&] { parse_shard_size(bad); });
    EXPECT_NE(e.find("is not a shard size"), std::string::npos) << bad << ": " << e;
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
