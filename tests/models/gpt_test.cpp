// GPT-2 (models/gpt.h): logits and parameter counts equal to those of a PyTorch GPT-2 in Hugging
// Face's layout (tests/models/gpt_reference.py, run by Debian's python3-torch), Hugging Face's
// names, one-line errors naming the values, causality, and a short training run.

#include "test_util.h"

#include "paratrain/io/safetensors.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

// The reference script's small shape (its SMALL).
models::GptOptions gpt_small_options() {
  return models::GptOptions().layers(2).width(64).heads(4).vocab(97).context(32);
}

std::string gpt_reference_script() {
  return std::string(PARATRAIN_TEST_DATA_DIR) + "/../models/gpt_reference.py";
}

int64_t gpt_numel(const torch::nn::Sequential& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) {
    n += p.numel();
  }
  return n;
}

// Expects `f` to throw a one-line c10::Error containing `needle`.
void expect_gpt_error(const std::function<void()>& f, const std::string& needle) {
  const std::string message = error_of(f);
  EXPECT_NE(message.find(needle), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

// The model's parameters under Hugging Face's names, as GPT2LMHeadModel saves them; without the
// "transformer." prefix when `bare`, as GPT2Model does.
void save_gpt_as_hugging_face(const torch::nn::Sequential& model,
                              const std::string& path,
                              bool bare = false) {
  std::map<std::string, torch::Tensor> state;
  for (const auto& p : model->named_parameters()) {
    const std::string name = models::hf_gpt2_name(p.key());
    state[bare ? name.substr(std::string("transformer.").size()) : name] = p.value().detach();
  }
  save_safetensors(state, path);
}

TEST(Gpt, MatchesAPyTorchReference) {
  if (!python_has("torch")) {
    GTEST_SKIP() << test_python()
                 << " has no torch (Debian's python3-torch) to write the reference";
  }
  const std::string prefix = "/tmp/" + unique_token("gpt-reference");
  auto r = run_process({test_python(), gpt_reference_script(), "logits", prefix}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = load_safetensors(prefix + "_ref.safetensors");
  // Built with dropout 0.1: eval() must turn every dropout off.
  auto model = models::gpt(gpt_small_options().dropout(0.1));
  // The file holds Hugging Face's extras too (lm_head.weight, the attn.bias masks): ignored.
  models::load_gpt2_safetensors(model, prefix + "_weights.safetensors");
  model->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(ref.at("tokens"));
  ASSERT_EQ(logits.sizes(), ref.at("logits").sizes());
  // Both sides run the same fp32 operations in the same order (the scale is a power of two,
  // 1/4, so multiplying here and dividing there round alike): against Debian's PyTorch 1.13 the
  // logits come out bitwise equal. 1e-5, a few ulps of the largest logit (about 20; an ulp at 16
  // is 2e-6), leaves room for other kernels (libtorch 2.x, another BLAS) summing in another
  // order. One tensor left at its initial value moves the logits by 0.5 or more (h1.ln_1.bias,
  // the least influential).
  const double diff = (logits - ref.at("logits")).abs().max().item<double>();
  EXPECT_LE(diff, 1e-5) << "largest logit " << ref.at("logits").abs().max().item<double>();
  for (const char* suffix : {"_weights.safetensors", "_ref.safetensors"}) {
    std::remove((prefix + suffix).c_str());
  }
}

TEST(Gpt, ParameterCountsEqualTheReference) {
  // Hugging Face's counts (sum of numel over GPT2LMHeadModel(config).parameters(), the tied head
  // once), by preset.
  const std::map<std::string, int64_t> hugging_face{{"gpt2", 124439808},
                                                    {"gpt2-medium", 354823168},
                                                    {"gpt2-large", 774030080},
                                                    {"gpt2-xl", 1557611200}};
  EXPECT_EQ(models::gpt_presets(),
            (std::vector<std::string>{"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}));
  for (const auto& kv : hugging_face) {
    EXPECT_EQ(models::gpt_parameter_count(models::gpt_options(kv.first)), kv.second) << kv.first;
  }
  // Built (not gpt2-xl: 6 GB): every parameter listed once, the head's weight being wte.
  auto gpt2 = models::make("gpt2", /*num_classes, ignored=*/10);
  EXPECT_EQ(gpt_numel(gpt2), hugging_face.at("gpt2"));
  EXPECT_EQ(gpt_numel(models::gpt(gpt_small_options())),
            models::gpt_parameter_count(gpt_small_options()));
  const auto names = models::names();
  EXPECT_NE(std::find(names.begin(), names.end(), "gpt2-xl"), names.end());
  EXPECT_EQ(models::input_shape("gpt2-medium"), (std::vector<int64_t>{1024}));

  if (!python_has("torch")) {
    GTEST_SKIP() << test_python() << " has no torch (Debian's python3-torch) to count with";
  }
  auto r = run_process({test_python(), gpt_reference_script(), "counts"}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, int64_t> reference;  // from lines "count NAME N"
  std::istringstream lines(r.output);
  std::string word, name;
  int64_t n = 0;
  while (lines >> word) {
    if (word == "count" && lines >> name >> n) {
      reference[name] = n;
    }
  }
  ASSERT_EQ(reference.size(), hugging_face.size() + 1) << r.output;
  for (const auto& preset : models::gpt_presets()) {
    EXPECT_EQ(models::gpt_parameter_count(models::gpt_options(preset)), reference.at(preset))
        << preset;
  }
  EXPECT_EQ(models::gpt_parameter_count(gpt_small_options()), reference.at("small"));
}

TEST(Gpt, NamesFollowHuggingFace) {
  torch::manual_seed(0);
  auto model = models::gpt(gpt_small_options());
  const auto params = model->named_parameters();
  const std::map<std::string, std::vector<int64_t>> shapes{{"embed.wte.weight", {97, 64}},
                                                           {"embed.wpe.weight", {32, 64}},
                                                           {"h0.ln_1.weight", {64}},
                                                           {"h0.attn.c_attn.weight", {64, 192}},
                                                           {"h0.attn.c_attn.bias", {192}},
                                                           {"h1.attn.c_proj.weight", {64, 64}},
                                                           {"h1.mlp.c_fc.weight", {64, 256}},
                                                           {"h1.mlp.c_proj.weight", {256, 64}},
                                                           {"h1.ln_2.bias", {64}},
                                                           {"ln_f.weight", {64}}};
  for (const auto& kv : shapes) {
    ASSERT_TRUE(params.contains(kv.first)) << kv.first;
    EXPECT_EQ(params[kv.first].sizes(), kv.second) << kv.first;
  }
  EXPECT_EQ(params.size(), 2u + 2 * 12 + 2);     // embeddings, 12 per block, ln_f; the head: none
  EXPECT_EQ(model->named_buffers().size(), 0u);  // the causal mask is no state
  EXPECT_EQ(models::hf_gpt2_name("embed.wte.weight"), "transformer.wte.weight");
  EXPECT_EQ(models::hf_gpt2_name("h12.mlp.c_fc.bias"), "transformer.h.12.mlp.c_fc.bias");
  EXPECT_EQ(models::hf_gpt2_name("ln_f.bias"), "transformer.ln_f.bias");
  EXPECT_EQ(models::gpt_block_names(model), (std::vector<std::string>{"h0", "h1"}));
  EXPECT_EQ(models::gpt_context(model), 32);
  EXPECT_EQ(models::gpt_context(models::make("mlp")), 0);

  // GPT2Model's names (no "transformer.") load too, into a model of other weights.
  const std::string path = "/tmp/" + unique_token("gpt-bare") + ".safetensors";
  save_gpt_as_hugging_face(model, path, /*bare=*/true);
  auto loaded = models::gpt(gpt_small_options());
  models::load_gpt2_safetensors(loaded, path);
  std::remove(path.c_str());
  model->eval();
  loaded->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor tokens = torch::randint(0, 97, {2, 32}, torch::kLong);
  const torch::Tensor logits = model->forward(tokens);
  EXPECT_TRUE(torch::equal(loaded->forward(tokens), logits));

  // A clone's head is tied to the clone's embedding (Note [The tied head of a cloned GPT]):
  // zeroing the clone's wte zeroes the clone's logits only.
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  ASSERT_NE(copy, nullptr);
  EXPECT_TRUE(torch::equal(copy->forward(tokens), logits));
  copy->parameters()[0].zero_();  // the clone's wte
  EXPECT_EQ(copy->forward(tokens).abs().max().item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(model->forward(tokens), logits));
}

TEST(Gpt, BadShapesAndInputsAreOneLine) {
  expect_gpt_error([] { models::gpt(models::GptOptions().width(100).heads(12)); },
                   "gpt: width 100 is not divisible by heads 12");
  expect_gpt_error([] { models::gpt_parameter_count(models::GptOptions().width(100).heads(12)); },
                   "gpt: width 100 is not divisible by heads 12");
  expect_gpt_error([] { models::gpt(gpt_small_options().layers(0)); },
                   "gpt: layers must be >= 1, got 0");
  expect_gpt_error([] { models::gpt(gpt_small_options().dropout(1.0)); },
                   "gpt: dropout must be in [0, 1), got 1");
  expect_gpt_error([] { models::gpt_options("gpt3"); },
                   "gpt: no preset 'gpt3': choose gpt2, gpt2-medium, gpt2-large or gpt2-xl");
  expect_gpt_error([] { models::hf_gpt2_name("fc.weight"); },
                   "hf_gpt2_name: 'fc.weight' is not the name of a gpt() parameter");

  auto model = models::gpt(gpt_small_options());
  expect_gpt_error(
      [&] {
        model->forward(torch::zeros({2, 33}, torch::kLong));
      },
      "gpt: the input has 33 tokens per sequence, but the model's context is 32; "
      "shorten the sequences or build the model with a longer context");
  expect_gpt_error(
      [&] {
        model->forward(torch::zeros({2, 8}));
      },
      "gpt: the input must be integer token ids (int64), got Float");
  expect_gpt_error([&] { model->forward(torch::zeros({8}, torch::kLong)); },
                   "gpt: the input must be token ids of shape [batch, tokens], got shape [8]");

  // Files of other shapes: the first tensor that differs, or is missing, is named.
  const std::string path = "/tmp/" + unique_token("gpt-other") + ".safetensors";
  save_gpt_as_hugging_face(models::gpt(gpt_small_options().width(32)), path);
  expect_gpt_error([&] { models::load_gpt2_safetensors(model, path); },
                   "gpt: tensor 'transformer.wte.weight' of " + path +
                       " has shape [97, 32], but the model's 'embed.wte.weight' has shape "
                       "[97, 64]; the file holds a GPT-2 of another shape");
  save_gpt_as_hugging_face(models::gpt(gpt_small_options().layers(1)), path);
  expect_gpt_error([&] { models::load_gpt2_safetensors(model, path); },
                   "gpt: " + path +
                       " has no tensor 'transformer.h.1.ln_1.weight' (nor 'h.1.ln_1.weight') for "
                       "the model's 'h1.ln_1.weight'");
  std::remove(path.c_str());
}

TEST(Gpt, CausalMaskHidesTheFuture) {
  torch::manual_seed(0);
  auto model = models::gpt(gpt_small_options());
  model->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor tokens = torch::randint(0, 97, {2, 32}, torch::kLong);
  const torch::Tensor before = model->forward(tokens);
  for (const int64_t t : {0, 13, 31}) {
    torch::Tensor changed = tokens.clone();
    changed.select(1, t).add_(1).remainder_(97);
    const torch::Tensor after = model->forward(changed);
    // The earlier positions see the same inputs through the same kernels (the future's scores are
    // -inf, so its weights are exactly 0): bitwise the same.
    EXPECT_TRUE(torch::equal(after.narrow(1, 0, t), before.narrow(1, 0, t))) << "token " << t;
    EXPECT_FALSE(torch::equal(after.select(1, t), before.select(1, t))) << "token " << t;
  }
}

TEST(Gpt, TrainsOnARepeatingSequence) {
  torch::manual_seed(0);
  auto model = models::gpt(models::GptOptions().layers(2).width(32).heads(2).vocab(16).context(16));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  // 3 1 4 1 5 9 2 6, repeated: after a 1 comes 4 or 5, so the model must look further back than
  // one token. Each row starts at another phase; targets are the inputs shifted by one.
  const torch::Tensor pattern = torch::tensor({3, 1, 4, 1, 5, 9, 2, 6}, torch::kLong);
  const torch::Tensor stream = pattern.repeat({5});
  std::vector<torch::Tensor> rows;
  for (int64_t phase = 0; phase < 8; ++phase) {
    rows.push_back(stream.narrow(0, phase, 17));
  }
  const torch::Tensor batch = torch::stack(rows);  // [8, 17]
  const torch::Tensor inputs = batch.narrow(1, 0, 16), targets = batch.narrow(1, 1, 16);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    adam.zero_grad();
    const torch::Tensor logits = model->forward(inputs);
    const torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.flatten(0, 1), targets.flatten());
    loss.backward();
    adam.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_GT(first, 2.0);  // about ln 16 at the start
  EXPECT_LT(last, 0.5) << "from " << first;
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
