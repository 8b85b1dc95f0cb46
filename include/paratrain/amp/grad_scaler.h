#pragma once

// GradScaler: dynamic loss scaling for fp16 training, with torch.cuda.amp.GradScaler's semantics
// and defaults (libtorch has none: PyTorch issue #44710).
//
//   paratrain::amp::GradScaler scaler;
//   for (...) {
//     opt.zero_grad();
//     torch::Tensor loss;
//     {
//       paratrain::amp::Autocast autocast(torch::kCUDA);
//       loss = loss_fn(model->forward(x), y);
//     }
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt);          // optional: to clip gradients at their true scale
//     scaler.step(opt);              // skipped when a gradient is inf or NaN
//     scaler.update();               // backs off after an overflow, grows after clean steps
//   }
//
// Semantics as PyTorch 1.13: scale(loss) multiplies by the scale (2^16 at first); unscale_
// divides every gradient of the optimizer by it and records whether any is inf or NaN (at most
// once per optimizer between updates; fp16 gradients are refused, as PyTorch's, since unscaling
// them in place loses precision: keep fp32 master gradients); step() unscales if needed and
// calls the optimizer's step unless an inf/NaN was found; update() multiplies the scale by
// backoff_factor (0.5) after any inf/NaN, or by growth_factor (2) after growth_interval (2000)
// consecutive clean updates. On CUDA tensors it uses libtorch's fused kernels
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_); libtorch 1.13 has no CPU
// kernels for them, so on the CPU the same arithmetic runs as ordinary tensor operations.

#include "paratrain/comm/process_group.h"

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <map>
#include <string>

namespace paratrain {
namespace amp {

struct GradScalerOptions {
  /// The first loss scale (torch.amp.GradScaler's init_scale).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after growth_interval steps without inf/NaN.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this at a step whose gradients hold inf/NaN.
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Steps without inf/NaN before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Disabled: scale() returns its input, step() just steps, the rest does nothing.
  TORCH_ARG(bool, enabled) = true;
  /// For gradients sharded over a group's ranks (FullyShardedDataParallel): unscale_ sums the
  /// ranks' inf/NaN findings over the group, so that every rank skips or steps together, as
  /// PyTorch's ShardedGradScaler does. unscale_ and step are then collectives. nullptr: the
  /// gradients are whole on every rank (one process, DDP).
  TORCH_ARG(dist::ProcessGroupPtr, process_group) = nullptr;
};

class GradScaler {
 public:
  /// Throws c10::Error unless growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0 and
  /// init_scale > 0.
  explicit GradScaler(GradScalerOptions options = {});

  /// `outputs` times the current scale (on the outputs' device).
  torch::Tensor scale(const torch::Tensor& outputs);
  /// Divides the optimizer's gradients by the scale in place and records inf/NaN. Throws when
  /// called twice for one optimizer before update(), after step(), before any scale(), or for
  /// fp16 gradients.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales (if not done yet) and steps the optimizer unless a gradient was inf or NaN.
  /// Returns whether it stepped. Throws when called twice before update().
  bool step(torch::optim::Optimizer& optimizer);
  /// Updates the scale from this iteration's inf/NaN checks (or sets `new_scale`). Throws when no
  /// optimizer was unscaled since the last update.
  void update(c10::optional<double> new_scale = c10::nullopt);

  /// The current scale (1 when disabled).
  double get_scale() const;
  int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }

  /// PyTorch's state_dict keys: scale, growth_factor, backoff_factor, growth_interval,
  /// _growth_tracker. Empty when disabled.
  std::map<std::string, double> state_dict() const;
  /// Throws c10::Error for an empty state (saved from a disabled scaler) or a missing key.
  void load_state_dict(const std::map<std::string, double>& state);
  /// The same state in a libtorch archive, next to a model's and optimizer's.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    torch::Tensor found_inf;  // 0 or more, float, on the scale's device
  };

  void ensure_scale(const torch::Device& device);
  void check_scale(const char* what) const;

  GradScalerOptions options_;
  torch::Tensor scale_;           // float32, one element, lazily on the first outputs' device
  torch::Tensor growth_tracker_;  // int32, one element
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  std::map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace amp
}  // namespace paratrain
