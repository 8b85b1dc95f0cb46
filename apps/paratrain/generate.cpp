// paratrain generate: continue a sequence of token ids with a GPT, as transformers' generate()
// does: greedy by default, or sampled with a temperature and top-k. The model is a GPT-2 preset
// or --model gpt's shape, or a Hugging Face model directory's (--load-weights DIR).

#include "args.h"
#include "commands.h"
#include "json_line.h"
#include "train_options.h"

#include "paratrain/models/generate.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/gpt_pretrained.h"

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& generate_spec() {
  static const CommandSpec spec{
      "paratrain generate",
      "paratrain generate --load-weights DIR --tokens 464,3290 [--max-new-tokens N]: continues\n"
      "the token ids with a GPT and prints the whole sequence, prompt first, as one line of\n"
      "comma-separated ids, as transformers' generate() returns it. Greedy (the likeliest\n"
      "token each time, do_sample=False) unless --top-k or --temperature asks for sampling.\n"
      "DIR is a Hugging Face GPT-2 directory (config.json gives the shape); a safetensors or\n"
      "torch.save file takes --model's shape. Each new token runs the model over the whole\n"
      "sequence (no key-value cache).",
      {
          {"model", "NAME", "gpt2 (default), gpt2-medium, gpt2-large, gpt2-xl, or gpt"},
          {"layers", "L", "--model gpt: transformer blocks"},
          {"width", "D", "--model gpt: the embedding width, n_embd"},
          {"heads", "H", "--model gpt: attention heads, a divisor of --width"},
          {"vocab", "V", "the vocabulary size (default 50257, GPT-2's)"},
          {"context", "N", "the model's context (default 1024; or config.json's n_positions)"},
          {"load-weights", "FILE|DIR",
           "the weights: a Hugging Face GPT-2 directory, a safetensors or torch.save file "
           "(without: random weights from --seed)"},
          {"tokens", "IDS", "the prompt's token ids, comma-separated (required)"},
          {"max-new-tokens", "N", "how many tokens to add (default 20)"},
          {"top-k", "K",
           "sample among the K likeliest tokens (default 50 when sampling, as transformers; 0: "
           "all)"},
          {"temperature", "T", "sample from softmax(logits / T) (default 1 when sampling)"},
          {"seed", "S", "the seed of the draws and of random weights (default 0)"},
          {"eos-token-id", "ID",
           "stop after generating this token (default: the directory's eos_token_id, as "
           "transformers; -1: never)"},
          {"json", "", "print {\"tokens\": [...], \"new_tokens\": [...]} instead"},
      }};
  return spec;
}

// "464,3290" -> {464, 3290}; a word that is not an integer is a usage error.
std::vector<int64_t> parse_tokens(const std::string& text) {
  std::vector<int64_t> out;
  for (const std::string& word : split_list(text)) {
    size_t used = 0;
    long long id = 0;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != word.size()) {
      throw UsageError("--tokens: '" + word +
                       "' is not a token id; give comma-separated integers, e.g. "
                       "--tokens 464,3290");
    }
    out.push_back(id);
  }
  if (out.empty()) {
    throw UsageError("--tokens is empty; give the prompt's token ids, e.g. --tokens 464,3290");
  }
  return out;
}

models::GenerateOptions generate_options(const Args& args, const std::string& weights) {
  models::GenerateOptions o;
  o.max_new_tokens(args.get_int("max-new-tokens", 20));
  o.sample(args.has("top-k") || args.has("temperature"));
  // transformers' generate(do_sample=True) keeps the 50 likeliest tokens unless top_k says
  // otherwise (GenerationConfig's default): so does --temperature without --top-k.
  o.top_k(args.get_int("top-k", 50)).temperature(args.get_double("temperature", 1.0));
  o.seed(static_cast<uint64_t>(args.get_int("seed", 0)));
  if (args.has("eos-token-id")) {
    const int eos = args.get_int("eos-token-id", -1);
    o.eos_token_ids(eos < 0 ? std::vector<int64_t>{} : std::vector<int64_t>{eos});
  } else if (!weights.empty() && std::filesystem::is_directory(weights)) {
    o.eos_token_ids(models::hf_eos_token_ids(weights));
  }
  return o;
}

// The GPT of the command line: its shape, and the weights of --load-weights.
torch::nn::Sequential build_gpt(const Args& args, const std::string& weights) {
  const std::string name = args.get("model", "gpt2");
  if (!train_detail::is_gpt(name)) {
    throw UsageError("unknown --model '" + name +
                     "': generate takes a GPT: gpt2, gpt2-medium, gpt2-large, gpt2-xl or gpt");
  }
  torch::manual_seed(args.get_int("seed", 0));
  torch::nn::Sequential model = models::gpt(train_detail::read_gpt(args, name));
  if (weights.empty()) {
    return model;
  }
  models::load_gpt_weights(model, weights);
  return model;
}

std::string join(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    // Appended piecewise: GCC 12 in C++20 mode (the official libtorch asks for it) warns about
    // `"," + std::string` falsely (-Wstringop-overflow).
    if (i > 0) {
      out += ',';
    }
    out += std::to_string(ids[i]);
  }
  return out;
}

}  // namespace

int run_generate(const std::vector<std::string>& argv) {
  Args args(argv, generate_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (!args.has("tokens")) {
    throw UsageError("give the prompt: --tokens 464,3290 (token ids, comma-separated)");
  }
  const std::vector<int64_t> prompt = parse_tokens(args.get("tokens"));
  const std::string weights = args.get("load-weights", "");
  const models::GenerateOptions options = generate_options(args, weights);
  const torch::nn::Sequential model = build_gpt(args, weights);
  const std::vector<int64_t> tokens = models::generate(model, prompt, options);
  if (args.has("json")) {
    const std::vector<int64_t> added(tokens.begin() + static_cast<long>(prompt.size()),
                                     tokens.end());
    std::cout << json_line(JsonRow{{"tokens", tokens}, {"new_tokens", added}}) << std::endl;
  } else {
    std::cout << join(tokens) << std::endl;
  }
  return 0;
}

}  // namespace cli
}  // namespace paratrain
