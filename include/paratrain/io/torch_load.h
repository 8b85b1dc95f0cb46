#pragma once

// Reading weights that PyTorch wrote with torch.save, and picking the reader by file content.

#include <torch/types.h>

#include <map>
#include <string>

namespace paratrain {

/// The tensors of a file written by torch.save(dict_of_tensors, path) (PyTorch's zip format), on
/// the CPU whatever device they were saved from. libtorch 1.13's unpickler cannot read the
/// OrderedDict that model.state_dict() pickles (it carries a _metadata attribute); the error then
/// says to save dict(model.state_dict()) or safetensors instead. Throws c10::Error naming the file
/// for anything unreadable, including damage libtorch would not notice: the pickle is checked
/// before libtorch reads it, and every tensor must lie inside the bytes stored for it.
std::map<std::string, torch::Tensor> load_torch_state_dict(const std::string& path);

/// The same for the `size` bytes of a torch.save file already in memory. `name` stands for the
/// file in error messages.
std::map<std::string, torch::Tensor> load_torch_state_dict_bytes(
    const void* data, size_t size, const std::string& name = "torch.save data");

/// Safetensors or torch.save, told apart by the file's first bytes (a zip archive is torch.save).
std::map<std::string, torch::Tensor> load_weights(const std::string& path);

}  // namespace paratrain
