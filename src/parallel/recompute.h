#pragma once

// Internal: what a recomputing backward (activation checkpointing, FSDP's checkpointed units)
// must put back to run a forward again exactly as it first ran: the random number generators'
// states (CPU and every CUDA device: dropout draws the same masks) and autocast's flags and
// dtypes (the Trainer's O1 scope covers forward only), as torch.utils.checkpoint does.

#include "amp/autocast_state.h"

#include "paratrain/io/checkpoint.h"

#include <torch/autograd.h>

#include <functional>
#include <string>

namespace paratrain {
namespace recompute {

/// Saves the current RNG and autocast state into `ctx` (keys "rng.*" and "autocast.*").
inline void save(torch::autograd::AutogradContext* ctx) {
  for (const auto& [key, value] : rng_state()) {
    ctx->saved_data["rng." + key] = value;
  }
  for (auto type : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    const std::string name = type == c10::DeviceType::CPU ? "cpu" : "cuda";
    ctx->saved_data["autocast." + name] = amp::detail::autocast_enabled(type);
    ctx->saved_data["autocast." + name + ".dtype"] =
        static_cast<int64_t>(amp::detail::autocast_dtype(type));
  }
}

/// Runs `forward` with grad, under the state save() kept in `ctx`; then puts back the state
/// backward found, whether `forward` returns or throws.
inline torch::Tensor replay(torch::autograd::AutogradContext* ctx,
                            const std::function<torch::Tensor()>& forward) {
  TensorMap saved;
  for (const auto& item : ctx->saved_data) {
    if (item.first.rfind("rng.", 0) == 0) {
      saved[item.first.substr(4)] = item.second.toTensor();
    }
  }
  struct Autocast {
    c10::DeviceType type;
    std::string name;
    bool on;
    at::ScalarType dtype;
  };
  std::vector<Autocast> now;
  for (auto type : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    const std::string name = type == c10::DeviceType::CPU ? "cpu" : "cuda";
    now.push_back(
        {type, name, amp::detail::autocast_enabled(type), amp::detail::autocast_dtype(type)});
  }
  const TensorMap rng_now = rng_state();
  auto put_back = [&] {
    set_rng_state(rng_now);
    for (const auto& a : now) {
      amp::detail::set_autocast_enabled(a.type, a.on);
      amp::detail::set_autocast_dtype(a.type, a.dtype);
    }
  };
  set_rng_state(saved);
  for (const auto& a : now) {
    amp::detail::set_autocast_enabled(a.type, ctx->saved_data["autocast." + a.name].toBool());
    amp::detail::set_autocast_dtype(
        a.type,
        static_cast<at::ScalarType>(ctx->saved_data["autocast." + a.name + ".dtype"].toInt()));
  }
  torch::Tensor out;
  try {
    torch::AutoGradMode enable(true);
    out = forward();
  } catch (...) {
    put_back();
    throw;
  }
  put_back();
  return out;
}

}  // namespace recompute
}  // namespace paratrain
