#pragma once

// Tensor and sequence parallelism: torch.distributed.tensor.parallel for libtorch modules.
// parallelize_module(module, mesh["tp"], plan) shards the weights of the submodules a plan names
// over the tensor-parallel group and puts the collectives of Megatron-LM's layers around them:
//
//   paratrain::ParallelizePlan plan{
//       {"h*.attn.c_attn", paratrain::ColwiseParallel().chunks(3)},   // q, k, v split by heads
//       {"h*.attn.c_proj", paratrain::RowwiseParallel()},
//       {"h*.mlp.c_fc", paratrain::ColwiseParallel()},
//       {"h*.mlp.c_proj", paratrain::RowwiseParallel()}};
//   auto layout = paratrain::parallelize_module(model, mesh["tp"], plan);
//
// (paratrain::models::gpt_parallelize_plan gives the GPT's whole plan, as torchtitan's Llama plan:
// models/gpt_parallel.h.)
//
// Styles (PyTorch's names and defaults):
//  - ColwiseParallel: the weight's output features are split over the ranks. Input Replicate
//    (its gradient all-reduced in backward), output Shard(-1) (each rank its features).
//  - RowwiseParallel: the input features are split. Input Shard(-1), output Replicate (the
//    partial products all-reduced), or Shard(1) (reduce-scattered over the sequence: sequence
//    parallel). On an Embedding, the vocabulary's rows are split and the input is the token ids.
//  - SequenceParallel: a LayerNorm (or a module without weights: dropout) runs on this rank's
//    part of the sequence (dimension 1); its weights' gradients are summed over the group.
//  - PrepareModuleInput / PrepareModuleOutput: change a module's input or output layout (say
//    Shard(1) to Replicate: an all-gather, whose backward keeps this rank's part of the whole
//    gradient; a ColwiseParallel with input_layouts Shard(1) gathers for itself and
//    reduce-scatters the partial gradient instead, half the bytes).
// Layouts are plain local tensors: a Shard(d) tensor is this rank's part along d, a Replicate
// one is whole on every rank. (PyTorch's DTensor and use_local_output have no counterpart: every
// output is local.)
//
// Supported modules: torch::nn::Linear, LinearLayer (models::Conv1D, Hugging Face's, weight
// [in, out]),
// torch::nn::Embedding, torch::nn::LayerNorm (SequenceParallel), and modules without
// parameters of their own, which take the layouts only (the GPT's head, tied to the embedding).
// A module takes its style only where its forward runs through call_with_hooks
// (parallel/module_hooks.h); the GPT's modules do. A module called directly (a plain
// torch::nn::Linear child) gets its weights split and no collective: wrong outputs, so route every
// module a plan names through call_with_hooks.
//
// Collectives go through the group's engine (all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor), so gloo under libtorch 1.13 uses the same pairwise reduce-scatter as
// FSDP. Every rank of the group must call parallelize_module with the same plan, and then run the
// same forwards and backwards.

#include "paratrain/comm/process_group.h"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace paratrain {

/// A tensor's layout over the tensor-parallel group: whole on every rank (Replicate) or split
/// along one dimension (Shard(d); negative d counts from the last).
struct Placement {
  bool shard = false;
  int64_t dim = 0;
  bool operator==(const Placement& other) const {
    return shard == other.shard && (!shard || dim == other.dim);
  }
  bool operator!=(const Placement& other) const { return !(*this == other); }
  /// "Replicate()" or "Shard(1)".
  std::string str() const;
};
/// A linear layer of a model's own (not torch::nn::Linear) that the styles split as one: its
/// parameters "weight" ([in, out] when weight_is_in_out(), as Hugging Face's Conv1D, else
/// [out, in] as Linear's) and "bias" ([out], optional). models::Conv1D is one.
class LinearLayer {
 public:
  virtual ~LinearLayer() = default;
  virtual bool weight_is_in_out() const = 0;
};

/// torch.distributed.tensor.Replicate.
struct Replicate : Placement {
  Replicate() : Placement{false, 0} {}
};
/// torch.distributed.tensor.Shard.
struct Shard : Placement {
  explicit Shard(int64_t d) : Placement{true, d} {}
};

struct ColwiseParallel {
  /// The input's layout: Replicate, or Shard(1) (all-gathered along the sequence first).
  TORCH_ARG(Placement, input_layouts) = Replicate();
  /// The output's layout: Shard(-1) (this rank's features), or Replicate (all-gathered).
  TORCH_ARG(Placement, output_layouts) = Shard(-1);
  /// paratrain's own: the output is `chunks` projections side by side, each split on its own
  /// (GPT-2's fused c_attn holds q, k and v: chunks 3, so each rank keeps its heads of each).
  TORCH_ARG(int64_t, chunks) = 1;
};

struct RowwiseParallel {
  /// The input's layout: Shard(-1) (a colwise module's output), or Replicate (token ids, for an
  /// Embedding).
  TORCH_ARG(Placement, input_layouts) = Shard(-1);
  /// The output's layout: Replicate (all-reduced), or Shard(1) (reduce-scattered along the
  /// sequence).
  TORCH_ARG(Placement, output_layouts) = Replicate();
};

struct SequenceParallel {
  /// The sequence dimension the module's input and output are split along.
  TORCH_ARG(int64_t, sequence_dim) = 1;
};

struct PrepareModuleInput {
  /// The layout the module's input comes in.
  TORCH_ARG(Placement, input_layouts) = Shard(1);
  /// The layout its forward gets.
  TORCH_ARG(Placement, desired_input_layouts) = Replicate();
};

struct PrepareModuleOutput {
  /// The layout the module's forward gives.
  TORCH_ARG(Placement, output_layouts) = Replicate();
  /// The layout its caller gets.
  TORCH_ARG(Placement, desired_output_layouts) = Shard(1);
};

using ParallelStyle = std::variant<ColwiseParallel,
                                   RowwiseParallel,
                                   SequenceParallel,
                                   PrepareModuleInput,
                                   PrepareModuleOutput>;

/// Submodule names (as named_modules() gives them, "*" matching any one name between dots, as
/// PyTorch's fnmatch) and their styles, applied in order.
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

/// How one parameter is split over the tensor-parallel ranks: along `dim`, in `chunks` pieces
/// each split on its own (ColwiseParallel::chunks).
struct TensorParallelShard {
  int64_t dim = 0;
  int64_t chunks = 1;
};

/// What parallelize_module split: the parameters' names (named_parameters() of the module it
/// was given) and how, over a group of `degree` ranks. Replicated parameters are not listed.
struct TensorParallelLayout {
  int degree = 1;
  std::map<std::string, TensorParallelShard> shards;
};

/// Applies `plan` to `module`'s submodules over `tp` (every rank of tp calls it): each named
/// module's weights are replaced in place by this rank's part, and its forward takes the
/// style's collectives. Throws c10::Error with one line for a plan entry that matches no
/// submodule (naming the model's children), a style on a module kind it does not support
/// (naming the kind and the kinds it does), a dimension the group's size does not divide
/// (naming the parameter, its size and the degree), and a null group.
TensorParallelLayout parallelize_module(const std::shared_ptr<torch::nn::Module>& module,
                                        const dist::ProcessGroupPtr& tp,
                                        const ParallelizePlan& plan);

/// The whole tensors of `local` (this rank's named parameters or state, by the names of
/// `layout`), all-gathered over `tp` for the parameters the layout splits; the others as they
/// are. A collective on tp: every rank passes the same names.
std::map<std::string, torch::Tensor> tensor_parallel_full_state(
    const std::map<std::string, torch::Tensor>& local,
    const TensorParallelLayout& layout,
    const dist::ProcessGroupPtr& tp);

/// The whole tensor from every rank's part along `dim` (an all-gather over `tp`, without
/// gradient): evaluation's logits under loss parallel.
torch::Tensor tensor_parallel_all_gather(const torch::Tensor& local,
                                         int64_t dim,
                                         const dist::ProcessGroupPtr& tp);

/// This rank's part of a whole tensor split as `shard` over `degree` ranks (`rank` of them).
torch::Tensor tensor_parallel_slice(const torch::Tensor& whole,
                                    const TensorParallelShard& shard,
                                    int rank,
                                    int degree);

/// The whole tensor from every rank's part, in rank order (`parts[r]` as tensor_parallel_slice
/// gives rank r's): the inverse of tensor_parallel_slice, without communication.
torch::Tensor tensor_parallel_join(const std::vector<torch::Tensor>& parts,
                                   const TensorParallelShard& shard);

/// This rank's place in the tensor-parallel group when parallelize_module left `module`'s output
/// split over it (ColwiseParallel's Shard(-1), RowwiseParallel's Shard(1)); nullopt when the
/// output is whole (Replicate()) or the module was not parallelized.
std::optional<int> tensor_parallel_sharded_output(const torch::nn::Module& module);

/// Dropout (torch::dropout) that draws a mask of its own on every tensor-parallel rank, for a
/// tensor split over them: `rank` (tensor_parallel_sharded_output of the module that made it;
/// nullopt: torch::dropout as it is, the same mask on every rank, which a whole tensor needs).
/// As Megatron-LM's model-parallel RNG tracker keeps one stream per rank for split regions and
/// the default one, equal on every rank, for whole ones. Each call's seed is drawn from the
/// default CPU generator, so a restored generator state replays the same masks.
torch::Tensor tensor_parallel_dropout(const torch::Tensor& x,
                                      double p,
                                      bool train,
                                      std::optional<int> rank);

/// Loss parallel (torch.distributed.tensor.parallel.loss_parallel): the mean cross entropy of
/// logits split over `tp` along the last dimension (rank r holding classes [r * V/tp,
/// (r+1) * V/tp)), without gathering them. `local_logits` is [N, V/tp] (or [B, T, V/tp]),
/// `target` the class of each row on every rank. Equal to cross_entropy on the whole logits.
torch::Tensor loss_parallel_cross_entropy(const torch::Tensor& local_logits,
                                          const torch::Tensor& target,
                                          const dist::ProcessGroupPtr& tp);

}  // namespace paratrain
