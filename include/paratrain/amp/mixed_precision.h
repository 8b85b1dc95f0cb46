#pragma once

// Opt levels as apex.amp defined them, for libtorch modules.
//
//   auto model = paratrain::models::make("cnn");
//   paratrain::amp::MixedPrecision amp(model, torch::kCPU,
//                                      paratrain::amp::AmpOptions().opt_level(OptLevel::kO2));
//   torch::optim::SGD opt(amp.optimizer_parameters(), torch::optim::SGDOptions(0.05));
//   for (...) {
//     opt.zero_grad();
//     torch::Tensor loss;
//     {
//       auto autocast = amp.autocast();                          // O1: an Autocast guard
//       loss = cross_entropy(amp.cast_output(model->forward(amp.cast_input(x))), y);
//     }
//     amp.backward(loss);                                        // scaled when scaling is on
//     amp.step(opt);                                             // unscale, step, update
//   }
//
//   O0  fp32 everywhere.
//   O1  autocast (bf16 on CPU, fp16 on CUDA by default): fp32 weights, operations cast per op;
//       dynamic loss scaling for fp16.
//   O2  the model cast to the half dtype except BatchNorm (kept fp32, as apex's
//       keep_batchnorm_fp32); fp32 master copies of the parameters, owned here and given to the
//       optimizer; step() copies the model's half gradients to the masters, steps them, and copies
//       the masters back into the model. Dynamic loss scaling for fp16.
//   O3  everything in the half dtype, the optimizer on the model's own parameters; no loss
//       scaling (apex's O3 uses a static scale of 1).
// bf16 has fp32's exponent range, so loss scaling is off by default with bf16 at every level;
// AmpOptions().loss_scaling(true) forces it on (O1 and O2 only: O3's gradients are half).
//
// With DDP, wrap the model after building MixedPrecision (gradients are then reduced in the
// model's dtype), then call sync_masters() (DDP has just broadcast rank 0's weights); the
// optimizer still gets optimizer_parameters().

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include "paratrain/amp/autocast.h"
#include "paratrain/amp/grad_scaler.h"

#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace amp {

enum class OptLevel { kO0, kO1, kO2, kO3 };

/// "O0".."O3" (letter O, case-insensitive); throws c10::Error for anything else.
OptLevel parse_opt_level(const std::string& name);
std::string to_string(OptLevel level);

struct AmpOptions {
  /// apex's opt level: O0 fp32, O1 autocast, O2 half model with fp32 master weights, O3 all half.
  TORCH_ARG(OptLevel, opt_level) = OptLevel::kO0;
  /// The half dtype; unset: bf16 on CPU, fp16 on CUDA.
  TORCH_ARG(c10::optional<at::ScalarType>, dtype) = c10::nullopt;
  /// Dynamic loss scaling; unset: on for fp16 at O1 and O2, off otherwise.
  TORCH_ARG(c10::optional<bool>, loss_scaling) = c10::nullopt;
  /// The dynamic loss scaler's settings, when loss scaling is on.
  TORCH_ARG(GradScalerOptions, scaler) = {};
};

class MixedPrecision {
 public:
  /// Prepares `model` (already on `device`) for the opt level. Throws c10::Error for a dtype the
  /// device cannot compute in (fp16 on the CPU: use bf16) or loss scaling forced at O3.
  MixedPrecision(std::shared_ptr<torch::nn::Module> model,
                 torch::Device device,
                 AmpOptions options = {});
  template <typename Impl>
  MixedPrecision(torch::nn::ModuleHolder<Impl> model, torch::Device device, AmpOptions options = {})
      : MixedPrecision(
            std::shared_ptr<torch::nn::Module>(model.ptr()), device, std::move(options)) {}

  /// O2: copies the model's parameters into the fp32 masters. Call it after anything writes the
  /// model's parameters outside step(): DDP's construction (it broadcasts rank 0's), loading
  /// weights. A no-op at the other levels.
  void sync_masters();
  /// What the optimizer must own: the fp32 masters at O2, the model's parameters otherwise.
  std::vector<torch::Tensor> optimizer_parameters() const;
  /// An Autocast guard at O1 (hold it around forward and loss), null otherwise.
  std::unique_ptr<Autocast> autocast() const;
  /// O2/O3: a floating-point input cast to the model's dtype; otherwise the input.
  torch::Tensor cast_input(const torch::Tensor& input) const;
  /// O2/O3: a half output cast to fp32 for the loss (apex's cast_model_outputs); otherwise the
  /// output.
  torch::Tensor cast_output(const torch::Tensor& output) const;
  /// loss (scaled when loss scaling is on) .backward().
  void backward(const torch::Tensor& loss);
  /// O2: half gradients to the fp32 masters; then the scaler's unscale_ when loss scaling is on.
  /// The gradients of optimizer_parameters() are then at their true scale, to clip or measure
  /// before step().
  void unscale_(torch::optim::Optimizer& optimizer);
  /// O2: half gradients to the fp32 masters (and cleared on the model). Then the scaler's
  /// unscale/step/update (or a plain step), and O2's masters copied back into the model.
  /// Returns whether the optimizer stepped (false after an inf/NaN gradient).
  bool step(torch::optim::Optimizer& optimizer);

  OptLevel opt_level() const { return options_.opt_level(); }
  at::ScalarType dtype() const { return dtype_; }
  bool loss_scaling() const { return scaler_.is_enabled(); }
  GradScaler& scaler() { return scaler_; }
  /// O2: the fp32 master of each model parameter (the parameter itself when it stayed fp32).
  const std::vector<torch::Tensor>& masters() const { return masters_; }

 private:
  void move_grads_to_masters();
  std::shared_ptr<torch::nn::Module> model_;
  torch::Device device_;
  AmpOptions options_;
  at::ScalarType dtype_;
  GradScaler scaler_;
  std::vector<torch::Tensor> params_;   // the model's, in parameters() order
  std::vector<torch::Tensor> masters_;  // O2 only, aligned with params_
};

}  // namespace amp
}  // namespace paratrain
