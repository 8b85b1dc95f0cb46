#pragma once

// GPT-2 as Hugging Face's transformers keeps it on disk: a model directory holding config.json and
// the weights, model.safetensors or shards with model.safetensors.index.json
// (io/safetensors_shards.h), as GPT2LMHeadModel.save_pretrained writes it and from_pretrained
// reads it.
//
//   namespace models = paratrain::models;
//   auto model = models::gpt(models::gpt2_config_options("my-gpt2"));  // config.json's shape
//   models::load_gpt2_safetensors(model, "my-gpt2");                  // its weights
//   ...                                                                 // fine-tune
//   models::save_gpt2_pretrained("my-gpt2-tuned", model);             // from_pretrained reads it
//
// The weights are saved by Hugging Face's names (hf_gpt2_name) and without lm_head.weight, which
// transformers ties to transformer.wte.weight as paratrain's head is tied, as save_pretrained
// leaves it out.

#include "paratrain/models/gpt.h"

#include <c10/core/ScalarType.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace models {

/// A model directory's config, as transformers names it.
constexpr const char* kHfConfigFile = "config.json";
/// save_pretrained's largest shard by default in huggingface_hub ("5GB"): gpt2-xl in fp32 (6.2 GB)
/// is two shards, the smaller presets one file.
constexpr int64_t kHfDefaultMaxShardBytes = 5000000000;

/// The shape a GPT-2 config.json gives (`path`: the file, or a model directory holding it):
/// n_layer, n_embd, n_head, vocab_size and n_positions, and the dropout (resid_pdrop, which
/// paratrain applies where embd_pdrop and attn_pdrop apply too). A field the file leaves out takes
/// GPT2Config's default, as transformers does. Throws c10::Error with one line naming the file
/// and the field for a config that is not GPT-2's or that paratrain's GPT cannot follow: a
/// model_type other than gpt2, an activation_function other than gelu_new (or
/// gelu_pytorch_tanh, the same function), layer_norm_epsilon other than 1e-5, n_inner other than
/// 4 n_embd, scale_attn_weights off, scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or
/// add_cross_attention on, tie_word_embeddings off, or three dropouts that differ.
GptOptions gpt2_config_options(const std::string& path);

/// The config.json of a GPT-2 of these shapes, as GPT2Config writes it (every field, sorted), with
/// `dtype` as the weights' dtype ("float32" for at::kFloat) and GPT-2's <|endoftext|> (50256) as
/// bos and eos token where the vocabulary holds it (null otherwise).
std::string gpt2_config_json(const GptOptions& options, at::ScalarType dtype = at::kFloat);

/// The shape of GPT-2 weights given by Hugging Face's names ("transformer.h.0.ln_1.weight"; with
/// or without "transformer."): layers from the blocks, width and vocab from wte, context from
/// wpe, and `heads`, which no tensor's shape tells. Throws c10::Error with one line naming the
/// first tensor that is missing, not GPT-2's, or of another shape than the others make it.
GptOptions gpt2_options_of_weights(const std::map<std::string, torch::Tensor>& tensors,
                                   int64_t heads);

/// Loads any weights a gpt() model takes: a Hugging Face model directory, index or GPT-2
/// safetensors file (by its names, "transformer.wte.weight" or "wte.weight") through
/// load_gpt2_safetensors; else a file of the model's own names (a safetensors file that
/// save_safetensors wrote, or torch.save's), strictly, as load_state_dict. Throws c10::Error
/// naming what does not match.
void load_gpt_weights(const torch::nn::Sequential& model, const std::string& path);

/// The tokens that end generation with a model directory's model, as transformers' generate()
/// finds them: eos_token_id of generation_config.json when there is one, else of config.json (a
/// number or a list; none when null or absent). Throws c10::Error naming a file that is not JSON
/// or a value that is not a token id.
std::vector<int64_t> hf_eos_token_ids(const std::string& dir);

/// Throws c10::Error with one line when `dir` already holds a model's files, as
/// save_gpt2_pretrained refuses it: to check before the weights to save are made.
void check_gpt2_pretrained_target(const std::string& dir);

/// Writes a Hugging Face model directory `dir` (made if missing): config.json for `options` and
/// `tensors` (all of a GPT-2 of those shapes, by Hugging Face's names, as gpt2_options_of_weights
/// checks them) as model.safetensors, or as shards of at most `max_shard_bytes` with their index
/// when they do not fit in one. Refuses, with one line and before writing anything, a directory
/// that already holds a model's files (config.json, model.safetensors and its shards or index,
/// PyTorch's pytorch_model*.bin): nothing of another model, nor an earlier export, is written
/// over or left mixed with the new files. Other files (a tokenizer's) stay as they are.
void save_gpt2_pretrained(const std::string& dir,
                          const std::map<std::string, torch::Tensor>& tensors,
                          const GptOptions& options,
                          int64_t max_shard_bytes = kHfDefaultMaxShardBytes);

/// The same for a gpt() model: its parameters, its shapes.
void save_gpt2_pretrained(const std::string& dir,
                          const torch::nn::Sequential& model,
                          int64_t max_shard_bytes = kHfDefaultMaxShardBytes);

}  // namespace models
}  // namespace paratrain
