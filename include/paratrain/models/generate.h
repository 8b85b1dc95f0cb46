#pragma once

// Text generation with a language model (a gpt(), or any module that maps [1, T] token ids to
// [1, T, vocab] logits), as transformers' generate() does it for one sequence: greedy decoding
// (do_sample=False) or sampling with a temperature and top-k.
//
//   auto model = paratrain::models::gpt(paratrain::models::gpt2_config_options("my-gpt2"));
//   paratrain::models::load_gpt2_safetensors(model, "my-gpt2");
//   std::vector<int64_t> tokens = paratrain::models::generate(
//       model, {464, 3290}, paratrain::models::GenerateOptions().max_new_tokens(20));
//
// Each new token runs the model over the whole sequence so far (no key-value cache): the logits
// are those of one forward, as a reference computes them, at a cost that grows with the square of
// the length. The model runs in eval mode (no dropout) and without autograd.

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace paratrain {
namespace models {

struct GenerateOptions {
  /// How many tokens to add to the prompt (transformers' max_new_tokens).
  TORCH_ARG(int64_t, max_new_tokens) = 20;
  /// false: the likeliest token each time (greedy; transformers' do_sample=False). true: a draw
  /// from the softmax of logits / temperature over the top_k likeliest tokens.
  TORCH_ARG(bool, sample) = false;
  /// Sampling: the number of likeliest tokens drawn from (0: all of them).
  TORCH_ARG(int64_t, top_k) = 0;
  /// Sampling: the logits are divided by this (> 0) before the softmax; below 1 sharpens.
  TORCH_ARG(double, temperature) = 1.0;
  /// Sampling: the seed of the draws, so a run repeats.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Generation ends once one of these tokens is generated, which is kept (transformers'
  /// eos_token_id, for one sequence); none: it never ends early.
  TORCH_ARG(std::vector<int64_t>, eos_token_ids) = {};
};

/// The prompt followed by the generated tokens. `context` bounds the whole sequence (the model's
/// positions; gpt_context(model) for a gpt()), `vocab` the token ids. Throws c10::Error with one
/// line, before running the model, for an empty prompt, a token outside [0, vocab), a prompt plus
/// max_new_tokens longer than the context (naming how many new tokens fit), or bad sampling
/// options.
std::vector<int64_t> generate(const torch::nn::Sequential& model,
                              const std::vector<int64_t>& prompt,
                              const GenerateOptions& options,
                              int64_t context,
                              int64_t vocab);

/// The same for a gpt() model, whose context and vocabulary are its own.
std::vector<int64_t> generate(const torch::nn::Sequential& model,
                              const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

}  // namespace models
}  // namespace paratrain
