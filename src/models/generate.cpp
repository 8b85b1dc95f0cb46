#include "paratrain/models/generate.h"

#include "paratrain/models/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace paratrain {
namespace models {

namespace {

void check_generate(const std::vector<int64_t>& prompt,
                    const GenerateOptions& o,
                    int64_t context,
                    int64_t vocab) {
  TORCH_CHECK(!prompt.empty(), "generate: the prompt is empty; give at least one token");
  for (size_t i = 0; i < prompt.size(); ++i) {
    TORCH_CHECK(prompt[i] >= 0 && prompt[i] < vocab, "generate: token ", prompt[i], " (number ",
                i + 1, " of the prompt) is outside the model's vocabulary of ", vocab,
                " tokens: ids go from 0 to ", vocab - 1);
  }
  TORCH_CHECK(o.max_new_tokens() >= 0, "generate: max_new_tokens must be >= 0, got ",
              o.max_new_tokens());
  const int64_t length = static_cast<int64_t>(prompt.size());
  TORCH_CHECK(length <= context, "generate: the prompt's ", length,
              " tokens do not fit the model's context of ", context, " positions");
  TORCH_CHECK(length + o.max_new_tokens() <= context, "generate: ", length, " prompt tokens and ",
              o.max_new_tokens(), " new ones make ", length + o.max_new_tokens(),
              ", more than the model's context of ", context, " positions: at most ",
              context - length, " new tokens fit after this prompt");
  if (o.sample()) {
    TORCH_CHECK(o.temperature() > 0 && std::isfinite(o.temperature()),
                "generate: the temperature must be a positive number, got ", o.temperature());
    TORCH_CHECK(o.top_k() >= 0, "generate: top_k must be >= 0 (0: every token), got ", o.top_k());
  }
}

// The next token from the last position's logits ([vocab], float, on the CPU).
int64_t next_token(const torch::Tensor& logits, const GenerateOptions& o, at::Generator& gen) {
  if (!o.sample()) {
    return logits.argmax().item<int64_t>();  // the first of equal maxima, as torch.argmax
  }
  torch::Tensor scaled = logits / o.temperature();
  torch::Tensor ids = torch::arange(scaled.size(0), torch::kLong);
  if (o.top_k() > 0 && o.top_k() < scaled.size(0)) {
    auto top = scaled.topk(o.top_k());
    scaled = std::get<0>(top);
    ids = std::get<1>(top);
  }
  const torch::Tensor probs = torch::softmax(scaled, 0);
  const int64_t drawn = torch::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
  return ids[drawn].item<int64_t>();
}

// Eval mode for the scope, then the mode the model had: generation leaves the model as it found
// it, also when a forward throws.
class EvalScope {
 public:
  explicit EvalScope(const torch::nn::Sequential& model)
      : model_(model), was_training_(model->is_training()) {
    model_->eval();
  }
  ~EvalScope() { model_->train(was_training_); }
  EvalScope(const EvalScope&) = delete;
  EvalScope& operator=(const EvalScope&) = delete;

 private:
  torch::nn::Sequential model_;
  bool was_training_;
};

}  // namespace

std::vector<int64_t> generate(const torch::nn::Sequential& model,
                              const std::vector<int64_t>& prompt,
                              const GenerateOptions& options,
                              int64_t context,
                              int64_t vocab) {
  check_generate(prompt, options, context, vocab);
  const auto parameters = model->parameters();
  const torch::Device device =
      parameters.empty() ? torch::Device(torch::kCPU) : parameters.front().device();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed());
  const EvalScope eval(model);
  torch::NoGradGuard no_grad;
  torch::nn::Sequential net = model;  // forward() is not const; the holder shares the module
  std::vector<int64_t> tokens = prompt;
  for (int64_t i = 0; i < options.max_new_tokens(); ++i) {
    const torch::Tensor input = torch::tensor(tokens, torch::kLong).view({1, -1}).to(device);
    const torch::Tensor logits = net->forward(input).select(0, 0).select(0, -1);
    TORCH_CHECK(logits.dim() == 1 && logits.size(0) == vocab, "generate: the model gave logits of ",
                "shape ", logits.sizes(), " for the last position, not [", vocab, "]");
    const int64_t token = next_token(logits.to(torch::kCPU, torch::kFloat), options, gen);
    tokens.push_back(token);
    const auto& eos = options.eos_token_ids();
    if (std::find(eos.begin(), eos.end(), token) != eos.end()) {
      break;
    }
  }
  return tokens;
}

std::vector<int64_t> generate(const torch::nn::Sequential& model,
                              const std::vector<int64_t>& prompt,
                              const GenerateOptions& options) {
  const GptOptions shape = gpt_options_of(model);
  return generate(model, prompt, options, shape.context(), shape.vocab());
}

}  // namespace models
}  // namespace paratrain
