#pragma once

// Forward hooks for libtorch modules: torch.nn.Module.register_forward_pre_hook and
// register_forward_hook, which libtorch's C++ modules lack. Tensor parallelism
// (parallelize_module) needs them to put its collectives around the modules it shards.
//
// A hook runs only where a module's forward is called through call_with_hooks: libtorch calls
// a child's forward directly, so a module that takes hooks says so by running its forward (or
// its parent, the child's) through call_with_hooks. paratrain's GPT (models/gpt.h) does so for
// every module a tensor-parallel plan names; another model does the same for the modules its
// plan names:
//
//   torch::Tensor forward(const torch::Tensor& x) {
//     return paratrain::call_with_hooks(*fc1, x, [&](const torch::Tensor& in) { return fc1(in); });
//   }
//
// Hooks belong to the module object (not to its clones); once it is gone they are dropped at the
// next registration or removal. Registering while another thread runs a forward of the same
// module is safe: that forward runs the hooks it started with. Forwards on several threads at
// once share the same hook objects, so a hook that keeps state must guard it.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>

namespace paratrain {

/// A hook on one tensor: before the forward (on its input, returning the input the forward
/// gets) or after it (on its output, returning what the caller gets).
using ForwardHook = std::function<torch::Tensor(const torch::Tensor&)>;

/// Adds a hook that runs before `module`'s forward, after those registered before it. The module
/// must be held by a shared_ptr (a ModuleHolder or a child); c10::Error otherwise.
void register_forward_pre_hook(const torch::nn::Module& module, ForwardHook hook);
/// Adds a hook that runs after `module`'s forward, after those registered before it.
void register_forward_hook(const torch::nn::Module& module, ForwardHook hook);
/// paratrain's own: a hook around the forward, given the input and the forward to run (the next
/// wrapper's, or the module's own), which it may call or replace (tensor parallelism computes a
/// sharded layer's output itself).
using ForwardFunction = std::function<torch::Tensor(const torch::Tensor&)>;
using ForwardWrapper =
    std::function<torch::Tensor(const torch::Tensor&, const ForwardFunction& forward)>;
/// Adds a wrapper around `module`'s forward, inside those registered before it; the pre-hooks run
/// before every wrapper and the hooks after them all.
void register_forward_wrapper(const torch::nn::Module& module, ForwardWrapper wrapper);
/// Removes every hook of `module`.
void remove_forward_hooks(const torch::nn::Module& module);
/// Whether `module` has a hook.
bool has_forward_hooks(const torch::nn::Module& module);

/// Runs `forward(input)` between `module`'s hooks: the pre-hooks on the input, then the
/// wrappers around the forward, then the hooks on the output. Without hooks it is
/// forward(input).
torch::Tensor call_with_hooks(const torch::nn::Module& module,
                              const torch::Tensor& input,
                              const ForwardFunction& forward);

}  // namespace paratrain
