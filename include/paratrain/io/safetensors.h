#pragma once

// Model state as safetensors (https://github.com/huggingface/safetensors format): an 8-byte
// little-endian header length, a JSON header mapping each tensor name to its dtype, shape and byte
// range, then the raw little-endian data. It is what the rest of the ecosystem reads (Python's
// safetensors, candle, ...), carries no code, and needs no libtorch to parse.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace paratrain {

/// Writes `tensors` (moved to CPU, made contiguous) to `path`. Throws c10::Error on I/O errors.
/// A safetensors file in pieces: the 8-byte length and header, then each tensor's bytes (on the
/// CPU, contiguous) in order. save_safetensors writes them; checkpoints checksum them as written.
struct SafetensorsParts {
  std::string header;
  std::vector<torch::Tensor> tensors;
};
/// `metadata` goes to the header's "__metadata__" (text to text, as the format has it), after
/// "format": "pt" (which it may replace); names and values must be UTF-8.
SafetensorsParts encode_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                                    const std::map<std::string, std::string>& metadata = {});

void save_safetensors(const std::map<std::string, torch::Tensor>& tensors, const std::string& path);

/// Which tensors of a file to read, by name (null: all of them).
using SafetensorsFilter = std::function<bool(const std::string& name)>;

/// Reads every tensor of a safetensors file (those `keep` accepts). Throws c10::Error naming the
/// file for anything that is not a well-formed safetensors file (bad length, bad JSON, unknown
/// dtype, out-of-range offsets).
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path,
                                                      const SafetensorsFilter& keep = nullptr);

/// The same for the `size` bytes of a safetensors file already in memory. `name` stands for the
/// file in error messages.
std::map<std::string, torch::Tensor> load_safetensors_bytes(
    const void* data,
    size_t size,
    const std::string& name = "safetensors data",
    const SafetensorsFilter& keep = nullptr);

/// The header's "__metadata__" of a safetensors file, reading only the header (empty when it has
/// none; a value that is not text comes back as its JSON). Throws c10::Error as load_safetensors.
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);
/// The same for a safetensors file already in memory.
std::map<std::string, std::string> safetensors_metadata_bytes(
    const void* data, size_t size, const std::string& name = "safetensors data");

/// A module's parameters and buffers by their libtorch names ("fc1.weight", "bn.running_mean").
std::map<std::string, torch::Tensor> module_state(const torch::nn::Module& module);

/// Copies a state into the module. With `strict` (the default, as PyTorch's load_state_dict) a
/// missing or unexpected name is an error; a shape mismatch always is. The error names the
/// tensors.
void load_module_state(torch::nn::Module& module,
                       const std::map<std::string, torch::Tensor>& state,
                       bool strict = true);

}  // namespace paratrain
