#include "paratrain/amp/grad_scaler.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <torch/torch.h>

#include "util/copies.h"

namespace paratrain {
namespace amp {

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), init_scale_(options.init_scale()) {
  TORCH_CHECK(options_.growth_factor() > 1.0, "GradScaler: growth_factor must be > 1, got ",
              options_.growth_factor());
  TORCH_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0,
              "GradScaler: backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  TORCH_CHECK(options_.growth_interval() > 0, "GradScaler: growth_interval must be > 0, got ",
              options_.growth_interval());
  TORCH_CHECK(options_.init_scale() > 0.0, "GradScaler: init_scale must be > 0, got ",
              options_.init_scale());
}

void GradScaler::ensure_scale(const torch::Device& device) {
  if (!scale_.defined()) {
    auto f = torch::TensorOptions().dtype(torch::kFloat).device(device);
    scale_ = torch::full({1}, init_scale_, f);
    growth_tracker_ = torch::full({1}, init_growth_tracker_, f.dtype(torch::kInt));
  }
}

void GradScaler::check_scale(const char* what) const {
  TORCH_CHECK(scale_.defined(), "GradScaler: ", what,
              " before any scale(): call scaler.scale(loss) earlier in the iteration");
}

torch::Tensor GradScaler::scale(const torch::Tensor& outputs) {
  if (!options_.enabled()) {
    return outputs;
  }
  ensure_scale(outputs.device());
  return outputs * ::paratrain::detail::to_device(scale_, outputs.device());
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return;
  }
  check_scale("unscale_()");
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "GradScaler: unscale_() has already been called on this optimizer since the last "
              "update()");
  TORCH_CHECK(state.stage != Stage::kStepped,
              "GradScaler: unscale_() is being called after step(); call update() first");
  // The reciprocal in double, as PyTorch, then float.
  const torch::Tensor inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  torch::Tensor found_inf = torch::zeros({1}, scale_.options().dtype(torch::kFloat));
  // Grouped by device: CUDA gradients go through the fused kernel, one call per device and
  // dtype, as PyTorch's _unscale_grads_.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<torch::Tensor>> cuda_groups;
  std::vector<torch::Tensor> cpu_grads;
  torch::NoGradGuard no_grad;
  // Everything is checked before anything is divided, as PyTorch's _unscale_grads_.
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const torch::Tensor& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      TORCH_CHECK(g.scalar_type() != torch::kHalf,
                  "GradScaler: attempting to unscale fp16 gradients; keep fp32 master weights "
                  "(opt level O2) or fp32 parameters (O1) so the optimizer sees fp32 gradients");
      TORCH_CHECK(!g.is_sparse(), "GradScaler: sparse gradients are not supported");
      if (g.is_cuda()) {
        cuda_groups[{g.device().str(), g.scalar_type()}].push_back(g);
      } else {
        cpu_grads.push_back(g);
      }
    }
  }
  const auto& group = options_.process_group();
  if (cuda_groups.empty() && cpu_grads.empty() && !group) {
    state.found_inf = torch::Tensor();  // step() then says no inf checks were recorded
    state.stage = Stage::kUnscaled;
    return;
  }
  // CPU: libtorch 1.13 has no CPU kernel for the fused op; the same arithmetic.
  for (auto& g : cpu_grads) {
    torch::Tensor bad = torch::logical_not(torch::isfinite(g)).any();
    found_inf.add_(bad.to(found_inf.device(), torch::kFloat));
    g.mul_(inv_scale.to(g.device()));  // computed in float, rounded once to the grad's dtype
  }
  for (auto& kv : cuda_groups) {
    const torch::Device device = kv.second.front().device();
    torch::Tensor here = torch::zeros({1}, torch::TensorOptions(torch::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(kv.second, here, inv_scale.to(device));
    found_inf.add_(here.to(found_inf.device()));
  }
  if (group && group->size() > 1) {
    torch::Tensor sum =
        found_inf.to(group->moves(found_inf.device().type()) ? found_inf.device() : torch::kCPU);
    group->allreduce(sum, dist::ReduceOp::kSum)->wait();
    found_inf.copy_(sum);
  }
  state.found_inf = found_inf;
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  check_scale("step()");
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kStepped,
              "GradScaler: step() has already been called since the last update()");
  if (state.stage == Stage::kReady) {
    unscale_(optimizer);
  }
  TORCH_CHECK(state.found_inf.defined(),
              "GradScaler: no inf checks were recorded for this optimizer (none of its "
              "parameters has a gradient)");
  const bool clean = state.found_inf.item<double>() == 0.0;
  if (clean) {
    optimizer.step();
  }
  state.stage = Stage::kStepped;
  return clean;
}

void GradScaler::update(c10::optional<double> new_scale) {
  if (!options_.enabled()) {
    return;
  }
  check_scale("update()");
  if (new_scale.has_value()) {
    TORCH_CHECK(*new_scale > 0, "GradScaler: the new scale must be > 0, got ", *new_scale);
    scale_.fill_(*new_scale);
  } else {
    torch::Tensor found;
    for (const auto& kv : per_optimizer_) {
      if (kv.second.found_inf.defined()) {
        found = found.defined() ? found + kv.second.found_inf : kv.second.found_inf;
      }
    }
    TORCH_CHECK(found.defined(),
                "GradScaler: no inf checks were recorded prior to update(); call step() or "
                "unscale_() first");
    if (scale_.is_cuda()) {
      at::_amp_update_scale_(scale_, growth_tracker_, found.to(scale_.device()),
                             options_.growth_factor(), options_.backoff_factor(),
                             options_.growth_interval());
    } else {
      // _amp_update_scale_'s arithmetic (CPU kernel missing in libtorch 1.13): the scale is
      // float32, the product rounded to float, and a growth to inf is not taken.
      float s = scale_.item<float>();
      int32_t tracker = growth_tracker_.item<int32_t>();
      if (found.item<double>() > 0) {
        s = static_cast<float>(s * options_.backoff_factor());
        tracker = 0;
      } else if (tracker + 1 == options_.growth_interval()) {
        const float grown = static_cast<float>(s * options_.growth_factor());
        if (std::isfinite(grown)) {
          s = grown;
        }
        tracker = 0;
      } else {
        tracker += 1;
      }
      scale_.fill_(s);
      growth_tracker_.fill_(tracker);
    }
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled()) {
    return 0;
  }
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled()) {
    return {};
  }
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled()) {
    return;
  }
  TORCH_CHECK(!state.empty(),
              "GradScaler: the source state is empty, possibly because it was saved from a "
              "disabled GradScaler");
  for (const char* key :
       {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TORCH_CHECK(state.count(key) == 1, "GradScaler: the state has no '", key, "'");
  }
  init_scale_ = state.at("scale");
  options_.growth_factor(state.at("growth_factor"));
  options_.backoff_factor(state.at("backoff_factor"));
  options_.growth_interval(static_cast<int64_t>(state.at("growth_interval")));
  init_growth_tracker_ = static_cast<int64_t>(state.at("_growth_tracker"));
  if (scale_.defined()) {
    scale_.fill_(init_scale_);
    growth_tracker_.fill_(init_growth_tracker_);
  }
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& kv : state_dict()) {
    archive.write("grad_scaler." + kv.first, torch::tensor(kv.second, torch::kDouble));
  }
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  std::map<std::string, double> state;
  for (const char* key :
       {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    torch::Tensor t;
    if (archive.try_read(std::string("grad_scaler.") + key, t)) {
      state[key] = t.item<double>();
    }
  }
  load_state_dict(state);
}

}  // namespace amp
}  // namespace paratrain
