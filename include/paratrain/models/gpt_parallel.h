#pragma once

// The GPT's tensor-parallel plan, as torchtitan's for Llama (torchtitan/models/llama3/
// parallelize.py), for parallelize_module (parallel/tensor_parallel.h):
//  - the token embedding split by the vocabulary (RowwiseParallel);
//  - attention split by heads: c_attn column-wise in three chunks (q, k and v), c_proj row-wise;
//  - the MLP column-wise (c_fc), then row-wise (c_proj);
//  - the head (tied to the embedding) gives each rank its part of the vocabulary, gathered
//    unless the loss is computed on the parts (loss parallel: loss_parallel_cross_entropy);
//  - with sequence parallelism, the LayerNorms and the residual stream hold each rank's part of
//    the sequence (Shard(1)): all-gathered by c_attn and c_fc (which keep only the part for
//    backward and gather it again there, as Megatron-LM does), reduce-scattered after attention
//    and the MLP.
//
//   auto layout = paratrain::parallelize_module(
//       model.ptr(), mesh["tp"], paratrain::models::gpt_parallelize_plan(model, tp_degree,
//       paratrain::models::GptParallelOptions().sequence_parallel(true).loss_parallel(true)));
//   auto loss = paratrain::loss_parallel_cross_entropy(model->forward(x), y, mesh["tp"]);

#include "paratrain/parallel/tensor_parallel.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <vector>

namespace paratrain {
namespace models {

struct GptParallelOptions {
  /// Split the LayerNorms and the residual stream along the sequence (Korthikanti et al.): the
  /// same bytes as all-reduces, as all-gathers and reduce-scatters, and 1/tp of the activations
  /// outside attention and the MLP. The sequence length must be a multiple of the degree.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Leave the logits split by the vocabulary (the head's output Shard(-1)) for
  /// loss_parallel_cross_entropy, instead of all-gathering them.
  TORCH_ARG(bool, loss_parallel) = false;
};

/// The plan for a gpt() model over `degree` tensor-parallel ranks. Throws c10::Error with one line
/// when the degree does not divide the heads or the vocabulary, naming which and the degrees that
/// would.
ParallelizePlan gpt_parallelize_plan(const torch::nn::Sequential& model,
                                     int degree,
                                     const GptParallelOptions& options = {});

/// The degrees that divide both the heads and the vocabulary of `model`, smallest first.
std::vector<int> gpt_tensor_parallel_degrees(const torch::nn::Sequential& model);

}  // namespace models
}  // namespace paratrain
