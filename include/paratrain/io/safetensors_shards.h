#pragma once

// Weights in several safetensors files, as Hugging Face's save_pretrained(max_shard_size=...)
// writes them and from_pretrained reads them: the shards model-00001-of-00003.safetensors, ...
// and the index model.safetensors.index.json,
//
//   {"metadata": {"total_parameters": 124439808, "total_size": 497759232},
//    "weight_map": {"transformer.h.0.attn.c_attn.bias": "model-00001-of-00003.safetensors", ...}}
//
// A model that fits in one shard is one file, model.safetensors, without an index (as
// save_pretrained writes it). Every shard carries the metadata {"format": "pt"}, which
// transformers requires of the files it loads.

#include "paratrain/io/safetensors.h"

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace paratrain {

/// Hugging Face's names for the weights of one file, and for the index of several.
constexpr const char* kSafetensorsWeightsFile = "model.safetensors";
constexpr const char* kSafetensorsIndexFile = "model.safetensors.index.json";

/// The tensors' names grouped into shards by huggingface_hub's split_torch_state_dict_into_shards's
/// rule, over the map's (name) order, which is not the model's: a tensor that would take the
/// current shard over `max_shard_bytes` starts a new one, and a tensor larger than
/// `max_shard_bytes` has a shard of its own. Throws c10::Error for a `max_shard_bytes` below 1.
std::vector<std::vector<std::string>> plan_safetensors_shards(
    const std::map<std::string, torch::Tensor>& tensors, int64_t max_shard_bytes);

/// Writes `tensors` into the directory `dir` (made if missing) as save_pretrained does:
/// model.safetensors when they fit in one shard of `max_shard_bytes`, else the shards of
/// plan_safetensors_shards and then the index, each file atomically. `metadata` goes into every
/// file, after "format": "pt". Returns the files' names in the order written. Throws c10::Error,
/// writing nothing, when `dir` already holds model weights (model.safetensors, the index, or a
/// model-*-of-*.safetensors shard): a save over another would mix the two.
std::vector<std::string> save_safetensors_shards(
    const std::string& dir,
    const std::map<std::string, torch::Tensor>& tensors,
    int64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata = {});

/// The tensors of a sharded checkpoint, read through its index (`index_path`,
/// model.safetensors.index.json; the shards are found beside it), those `keep` accepts. Throws
/// c10::Error with one line, before reading any shard, for an index that is not Hugging Face's
/// JSON, one whose weight_map names a shard that is missing (naming the shard and a tensor it
/// should hold), or a shard file outside the index's directory; and, while reading, for a shard
/// that lacks a tensor the index places in it.
std::map<std::string, torch::Tensor> load_safetensors_shards(
    const std::string& index_path, const SafetensorsFilter& keep = nullptr);

/// Sizes as save_pretrained's max_shard_size takes them: "500KB", "5GB" (powers of 1000, as
/// huggingface_hub's parse_size_to_int; fractions allowed, "1.5GB"), "4MiB" (powers of 1024), or
/// bytes ("4096"). Throws c10::Error naming `text` for anything else, or a size below 1 byte.
int64_t parse_shard_size(const std::string& text);

}  // namespace paratrain
