#pragma once

// Activation checkpointing, as torch.utils.checkpoint: a function's forward keeps only its input,
// and its backward runs the function again, with grad, to get the activations it needs. Memory
// for activations drops to the inputs of the checkpointed parts, for the price of a second
// forward. The recompute replays the random number generators' states (CPU and every CUDA
// device), so dropout draws the same masks; on CPU the gradients equal, bit for bit, those of
// the run without checkpointing.
//
//   auto y = paratrain::checkpoint([&](const torch::Tensor& x) { return block->forward(x); }, x);
//   auto model = paratrain::apply_activation_checkpointing(gpt,
//   paratrain::models::gpt_block_names(gpt));
//
// The parameters the function uses receive their gradients when its backward runs (as the
// reentrant torch.utils.checkpoint gives them), whether or not its input requires grad.
// FullyShardedDataParallel checkpoints its units itself (FsdpOptions::activation_checkpointing),
// gathering each unit's weights once for the recompute and the backward.

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

namespace paratrain {

/// Runs `function(input)` without keeping its activations; backward recomputes them. Without
/// grad mode (evaluation) it is a plain call.
torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& function,
                         const torch::Tensor& input);

/// A Sequential with the same children (the same modules, not copies) and the same parameter
/// names, whose children named in `names` run through checkpoint(). Throws c10::Error naming a
/// name that is not a child.
/// (torch.distributed's apply_activation_checkpointing wraps the chosen submodules in place;
/// libtorch's Sequential cannot swap a child, so this returns the wrapped Sequential.)
torch::nn::Sequential apply_activation_checkpointing(const torch::nn::Sequential& model,
                                                     const std::vector<std::string>& names);
[[deprecated(
    "checkpoint_children is now apply_activation_checkpointing, as torch.distributed "
    "names it")]] inline torch::nn::Sequential
checkpoint_children(const torch::nn::Sequential& model, const std::vector<std::string>& names) {
  return apply_activation_checkpointing(model, names);
}

}  // namespace paratrain
