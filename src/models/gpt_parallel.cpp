#include "paratrain/models/gpt_parallel.h"

#include "paratrain/models/gpt.h"

#include <c10/util/Exception.h>

#include <string>

namespace paratrain {
namespace models {

std::vector<int> gpt_tensor_parallel_degrees(const torch::nn::Sequential& model) {
  const GptOptions o = gpt_options_of(model);
  std::vector<int> out;
  for (int64_t d = 1; d <= o.heads(); ++d) {
    if (o.heads() % d == 0 && o.vocab() % d == 0) {
      out.push_back(static_cast<int>(d));
    }
  }
  return out;
}

namespace {

std::string listed(const std::vector<int>& degrees) {
  std::string out;
  for (size_t i = 0; i < degrees.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == degrees.size() ? " or " : ", ") + std::to_string(degrees[i]);
  }
  return out;
}

}  // namespace

ParallelizePlan gpt_parallelize_plan(const torch::nn::Sequential& model,
                                     int degree,
                                     const GptParallelOptions& options) {
  const GptOptions o = gpt_options_of(model);
  TORCH_CHECK(degree >= 1, "gpt: the tensor-parallel degree must be >= 1, got ", degree);
  const std::string choose = "; choose " + listed(gpt_tensor_parallel_degrees(model));
  TORCH_CHECK(o.heads() % degree == 0, "gpt: a tensor-parallel degree of ", degree,
              " does not divide the ", o.heads(), " attention heads", choose);
  TORCH_CHECK(o.vocab() % degree == 0, "gpt: a tensor-parallel degree of ", degree,
              " does not divide the vocabulary of ", o.vocab(), choose,
              " (or pad the vocabulary to a multiple)");
  const bool sp = options.sequence_parallel();
  const Placement residual = sp ? Placement(Shard(1)) : Placement(Replicate());
  ParallelizePlan plan{
      {"embed.wte", RowwiseParallel().input_layouts(Replicate()).output_layouts(Replicate())},
  };
  if (sp) {
    plan.push_back(
        {"embed",
         PrepareModuleOutput().output_layouts(Replicate()).desired_output_layouts(Shard(1))});
    plan.push_back({"h*.ln_1", SequenceParallel()});
    plan.push_back({"h*.ln_2", SequenceParallel()});
    plan.push_back({"ln_f", SequenceParallel()});
  }
  // Under sequence parallelism c_attn and c_fc gather their input themselves, which keeps only
  // each rank's part of it for backward (torchtitan puts a PrepareModuleInput on attention and the
  // MLP instead; DTensor then keeps the gathered input).
  plan.push_back({"h*.attn.c_attn", ColwiseParallel().chunks(3).input_layouts(residual)});
  plan.push_back({"h*.attn.c_proj", RowwiseParallel().output_layouts(residual)});
  plan.push_back({"h*.mlp.c_fc", ColwiseParallel().input_layouts(residual)});
  plan.push_back({"h*.mlp.c_proj", RowwiseParallel().output_layouts(residual)});
  plan.push_back(
      {"head", ColwiseParallel().input_layouts(residual).output_layouts(
                   options.loss_parallel() ? Placement(Shard(-1)) : Placement(Replicate()))});
  return plan;
}

}  // namespace models
}  // namespace paratrain
