#pragma once

// Conv1D: Hugging Face's GPT-2 projection, a Linear whose weight is stored [in, out] (as GPT-2's
// TensorFlow checkpoints had it), so that a checkpoint's tensors load without transposing.
// Initialised normal(0, init_std), bias zero. Its forward takes forward hooks
// (parallel/module_hooks.h), so tensor parallelism can split it (ColwiseParallel splits the
// weight's columns, RowwiseParallel its rows).

#include "paratrain/parallel/tensor_parallel.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <ostream>

namespace paratrain {
namespace models {

struct Conv1DImpl : torch::nn::Cloneable<Conv1DImpl>, LinearLayer {
  /// A projection from `in` to `out` features.
  Conv1DImpl(int64_t in, int64_t out, double init_std);
  /// Makes the parameters and, unless a gpt() with GptOptions::defer_init is being built,
  /// initialises them (reset_parameters).
  void reset() override;
  /// Writes the initial values: weight normal(0, init_std), bias zero.
  void reset_parameters();
  /// [..., in] -> [..., out]: x @ weight + bias (the weight's own sizes, which tensor
  /// parallelism may have split).
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;
  bool weight_is_in_out() const override { return true; }

  int64_t in_, out_;
  double std_;
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv1D);

}  // namespace models
}  // namespace paratrain
