#include "paratrain/amp/mixed_precision.h"

#include "util/batchnorm.h"

#include <torch/torch.h>
#include "paratrain/optim/fused.h"
#include "paratrain/util/cpu_kernels.h"

#include <cctype>

namespace paratrain {
namespace amp {

OptLevel parse_opt_level(const std::string& name) {
  std::string n;
  for (char c : name) {
    n.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  }
  if (n == "O0") {
    return OptLevel::kO0;
  }
  if (n == "O1") {
    return OptLevel::kO1;
  }
  if (n == "O2") {
    return OptLevel::kO2;
  }
  if (n == "O3") {
    return OptLevel::kO3;
  }
  TORCH_CHECK(false, "unknown opt level '", name, "': choose O0, O1, O2 or O3 (the letter O)");
}

std::string to_string(OptLevel level) {
  switch (level) {
    case OptLevel::kO0:
      return "O0";
    case OptLevel::kO1:
      return "O1";
    case OptLevel::kO2:
      return "O2";
    case OptLevel::kO3:
      return "O3";
  }
  return "?";
}

namespace {

GradScalerOptions scaler_options(const AmpOptions& o, at::ScalarType dtype) {
  const OptLevel level = o.opt_level();
  const bool by_default = dtype == at::kHalf && (level == OptLevel::kO1 || level == OptLevel::kO2);
  const bool on = o.loss_scaling().value_or(by_default);
  TORCH_CHECK(!on || level != OptLevel::kO3,
              "loss scaling at opt level O3 is not supported: its gradients are half precision, "
              "which cannot be unscaled in place without losing them; use O2 (fp32 masters)");
  GradScalerOptions s = o.scaler();
  s.enabled(on && level != OptLevel::kO0);
  return s;
}

}  // namespace

MixedPrecision::MixedPrecision(std::shared_ptr<torch::nn::Module> model,
                               torch::Device device,
                               AmpOptions options)
    : model_(std::move(model)),
      device_(device),
      options_(options),
      dtype_(options.dtype().value_or(default_dtype(device.type()))),
      scaler_(scaler_options(options, dtype_)) {
  TORCH_CHECK(model_ != nullptr, "MixedPrecision: the model is null");
  const OptLevel level = options_.opt_level();
  if (level != OptLevel::kO0) {
    // Autocast's limits are the build's limits for half compute too: fp16 on the CPU is refused
    // with what to use instead.
    check_autocast_supported(device.type(), dtype_);
    if (device.is_cpu()) {
      cpu::ensure_bf16_convolutions();  // Note [CPU kernels that do not run]
    }
  }
  torch::NoGradGuard no_grad;
  if (level == OptLevel::kO2 || level == OptLevel::kO3) {
    // Module by module, each one's own tensors: O2 leaves BatchNorm's in fp32.
    for (const auto& m : model_->modules(/*include_self=*/true)) {
      if (level == OptLevel::kO2 && paratrain::detail::is_any_batchnorm(*m)) {
        continue;
      }
      for (auto& p : m->named_parameters(/*recurse=*/false)) {
        if (p.value().is_floating_point()) {
          p.value().set_data(p.value().to(dtype_));
        }
      }
      for (auto& b : m->named_buffers(/*recurse=*/false)) {
        if (b.value().is_floating_point()) {
          b.value().set_data(b.value().to(dtype_));
        }
      }
    }
  }
  // Once each: a tied weight appears twice in parameters(), and two masters would fight.
  for (const auto& p : model_->parameters()) {
    bool seen = false;
    for (const auto& q : params_) {
      seen = seen || q.is_same(p);
    }
    if (!seen) {
      params_.push_back(p);
    }
  }
  if (level == OptLevel::kO2) {
    for (const auto& p : params_) {
      if (p.scalar_type() == at::kFloat) {
        masters_.push_back(p);  // BatchNorm's: already fp32, the optimizer steps it directly
      } else {
        masters_.push_back(p.detach().to(at::kFloat).clone().requires_grad_(p.requires_grad()));
      }
    }
  }
}

void MixedPrecision::sync_masters() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < masters_.size(); ++i) {
    if (!masters_[i].is_same(params_[i])) {
      masters_[i].copy_(params_[i]);
    }
  }
}

std::vector<torch::Tensor> MixedPrecision::optimizer_parameters() const {
  return options_.opt_level() == OptLevel::kO2 ? masters_ : params_;
}

std::unique_ptr<Autocast> MixedPrecision::autocast() const {
  if (options_.opt_level() != OptLevel::kO1) {
    return nullptr;
  }
  return std::make_unique<Autocast>(device_.type(), dtype_);
}

torch::Tensor MixedPrecision::cast_input(const torch::Tensor& input) const {
  const OptLevel level = options_.opt_level();
  if ((level == OptLevel::kO2 || level == OptLevel::kO3) && input.is_floating_point()) {
    return input.to(dtype_);
  }
  return input;
}

torch::Tensor MixedPrecision::cast_output(const torch::Tensor& output) const {
  const OptLevel level = options_.opt_level();
  if ((level == OptLevel::kO2 || level == OptLevel::kO3) && output.is_floating_point()) {
    return output.to(at::kFloat);
  }
  return output;
}

void MixedPrecision::backward(const torch::Tensor& loss) {
  scaler_.scale(loss).backward();
}

void MixedPrecision::move_grads_to_masters() {
  if (options_.opt_level() != OptLevel::kO2) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i];
    torch::Tensor& m = masters_[i];
    if (m.is_same(p) || !p.grad().defined()) {
      continue;
    }
    if (m.grad().defined()) {
      m.mutable_grad().copy_(p.grad());
    } else {
      m.mutable_grad() = p.grad().to(m.device(), at::kFloat);
    }
    // The model's half gradients are a staging area: the optimizer zeroes the masters' only.
    p.mutable_grad() = torch::Tensor();
  }
}

void MixedPrecision::unscale_(torch::optim::Optimizer& optimizer) {
  move_grads_to_masters();
  if (scaler_.is_enabled()) {
    scaler_.unscale_(optimizer);
  }
}

bool MixedPrecision::step(torch::optim::Optimizer& optimizer) {
  const bool o2 = options_.opt_level() == OptLevel::kO2;
  move_grads_to_masters();  // a no-op after unscale_()
  // A fused optimizer writes the model's half parameters in its own pass over the masters.
  auto* fused = o2 ? dynamic_cast<optim::FusedOptimizer*>(&optimizer) : nullptr;
  if (fused != nullptr) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const torch::Tensor& m = masters_[i];
      const torch::Tensor& half = params_[i];
      if (!m.is_same(half) && !fused->writes_copy(m) && fused->can_write_copy(m, half)) {
        fused->write_copy(m, half);
      }
    }
  }
  bool stepped = true;
  if (scaler_.is_enabled()) {
    stepped = scaler_.step(optimizer);
    scaler_.update();
  } else {
    optimizer.step();
  }
  if (o2 && stepped) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!masters_[i].is_same(params_[i]) &&
          (fused == nullptr || !fused->writes_copy(masters_[i]))) {
        params_[i].copy_(masters_[i]);
      }
    }
  }
  return stepped;
}

}  // namespace amp
}  // namespace paratrain
