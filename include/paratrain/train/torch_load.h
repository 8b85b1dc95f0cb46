#pragma once

// Reading weights that PyTorch wrote with torch.save, and picking the reader by file content.

#include <torch/types.h>

#include <map>
#include <string>

namespace paratrain {

/// The tensors of a file written by torch.save(dict_of_tensors, path) (PyTorch's zip format).
/// libtorch 1.13's unpickler cannot read the OrderedDict that model.state_dict() pickles (it
/// carries a _metadata attribute); the error then says to save dict(model.state_dict()) or
/// safetensors instead. Throws c10::Error naming the file for anything unreadable.
std::map<std::string, torch::Tensor> load_torch_state_dict(const std::string& path);

/// Safetensors or torch.save, told apart by the file's first bytes (a zip archive is torch.save).
std::map<std::string, torch::Tensor> load_weights(const std::string& path);

}  // namespace paratrain
