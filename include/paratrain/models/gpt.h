#pragma once

// GPT-2: a decoder-only transformer with the architecture of Radford et al. (2019) and of Hugging
// Face's GPT2LMHeadModel: learned position embeddings, pre-LayerNorm blocks (eps 1e-5), causal
// self-attention, a 4x MLP with the tanh GELU, a final LayerNorm, and the output head tied to the
// token embedding (no weights of its own).
//
//   auto model = paratrain::models::gpt(paratrain::models::gpt_options("gpt2").context(256));
//   torch::Tensor logits = model->forward(tokens);   // [B, T] int64 -> [B, T, vocab]
//
// The model is a torch::nn::Sequential, so every strategy that takes one (DDP, pipelines, the
// Trainer, FullyShardedDataParallel with one unit per block) takes it. Its children:
//   embed   token and position embeddings (embed.wte.weight [vocab, width], embed.wpe.weight
//           [context, width]) and the embedding dropout
//   h0..hN  the blocks: ln_1, attn.c_attn (width -> 3 width), attn.c_proj, ln_2, mlp.c_fc
//           (width -> 4 width), mlp.c_proj; every projection is Hugging Face's Conv1D, weight
//           [in, out], so a checkpoint's tensors load as they are
//   ln_f    the final LayerNorm
//   head    logits = x @ embed.wte.weight^T; it registers no parameter (the weight is the
//           embedding's), so parameters() lists each tensor once, as libtorch's optimizers need
//
// Names map to Hugging Face's by hf_gpt2_name(): "h3.attn.c_attn.weight" is
// "transformer.h.3.attn.c_attn.weight". Initialisation is GPT-2's: normal(0, 0.02) weights and
// embeddings, zero biases, and the residual projections (attn.c_proj, mlp.c_proj) at
// 0.02 / sqrt(2 * layers).

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

namespace paratrain {
namespace models {

struct GptOptions {
  /// Transformer blocks (n_layer).
  TORCH_ARG(int64_t, layers) = 12;
  TORCH_ARG(int64_t, width) = 768;  // n_embd
  /// Attention heads per block (n_head); width must be a multiple.
  TORCH_ARG(int64_t, heads) = 12;
  /// Vocabulary size (vocab_size), the rows of the token embedding.
  TORCH_ARG(int64_t, vocab) = 50257;
  /// The longest input (n_positions): the position embedding's rows.
  TORCH_ARG(int64_t, context) = 1024;
  /// Embedding, attention and residual dropout (GPT-2 trained with 0.1; 0 is nanoGPT's default).
  TORCH_ARG(double, dropout) = 0.0;
  /// Allocate the large parameters without writing them, as building on PyTorch's meta device
  /// defers them: the kernel gives the memory only when it is written, so a model larger than
  /// the machine can be built and each piece initialised, used and freed in turn (FSDP does, with
  /// FsdpOptions::param_init_fn(gpt_init_weights)). The values are undefined until
  /// gpt_init_weights runs on every child, in order; then they are gpt()'s, bit for bit.
  TORCH_ARG(bool, defer_init) = false;
};

/// The shapes of "gpt2" (124M), "gpt2-medium" (350M), "gpt2-large" (774M), "gpt2-xl" (1.5B);
/// c10::Error listing them for another name.
GptOptions gpt_options(const std::string& preset);
/// The preset names, smallest first.
std::vector<std::string> gpt_presets();

/// A GPT-2 of these shapes. Throws c10::Error with one line for a shape that does not make one
/// (width not divisible by heads, any size below 1, dropout outside [0, 1)).
torch::nn::Sequential gpt(const GptOptions& options);

/// Initialises `module` and everything under it as gpt() does (torchtitan's init_weights): a child
/// of a gpt(GptOptions().defer_init(true)) model. Called on the children in the model's order, it
/// draws from the default generator as gpt() would have, so the weights are gpt()'s. Modules that
/// are not the GPT's are left as they are.
void gpt_init_weights(torch::nn::Module& module);

/// The number of parameters a model of these shapes has (the tied head counted once), without
/// building it: (vocab + context) * width + layers * (12 width^2 + 13 width) + 2 width. Throws as
/// gpt() does for shapes that make no model.
int64_t gpt_parameter_count(const GptOptions& options);

/// Hugging Face's name of one of gpt()'s parameters ("embed.wte.weight" ->
/// "transformer.wte.weight", "h0.ln_1.bias" -> "transformer.h.0.ln_1.bias").
std::string hf_gpt2_name(const std::string& name);

/// Loads Hugging Face GPT-2 weights into `model`. `path` is a model directory as save_pretrained
/// writes it (config.json, and model.safetensors or shards with model.safetensors.index.json), a
/// model.safetensors.index.json, or one safetensors file (model.safetensors, or one saved with
/// hf_gpt2_name's names). Names with or without the "transformer." prefix are found
/// (GPT2LMHeadModel saves them with it, GPT2Model, as the hub's gpt2 files, without). Tensors
/// Hugging Face stores besides the weights (the attention's "bias" masks, a "lm_head.weight" equal
/// to wte) are ignored. From a directory the model must have config.json's shape
/// (gpt2_config_options in models/gpt_pretrained.h), or a shorter context, which keeps the first
/// rows of the position embedding (as nanoGPT's crop_block_size), and the weights must be those
/// config.json describes. Throws c10::Error naming the first missing tensor or the first shape
/// that differs (both shapes; config.json's when it is to blame), before copying anything.
void load_gpt2_safetensors(const torch::nn::Sequential& model, const std::string& path);

/// The shapes a gpt() model was built with (its context: the position embedding's rows). Throws
/// c10::Error for another model.
GptOptions gpt_options_of(const torch::nn::Sequential& model);

/// The context a gpt() model takes (its position embedding's rows); 0 for another model.
int64_t gpt_context(const torch::nn::Sequential& model);

/// The names of the model's blocks ("h0", "h1", ...): the units FullyShardedDataParallel wraps.
std::vector<std::string> gpt_block_names(const torch::nn::Sequential& model);

}  // namespace models
}  // namespace paratrain
