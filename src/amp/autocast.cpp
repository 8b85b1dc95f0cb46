#include "paratrain/amp/autocast.h"

#include "autocast_state.h"
#include "paratrain/util/cpu_kernels.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace paratrain {
namespace amp {

at::ScalarType default_dtype(c10::DeviceType device_type) {
  return device_type == c10::DeviceType::CPU ? at::kBFloat16 : at::kHalf;
}

void check_autocast_supported(c10::DeviceType device_type, at::ScalarType dtype) {
  TORCH_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
              "autocast on ", device_type, " is not supported: use cpu or cuda");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "autocast to ", dtype,
              " is not supported: use bf16 or fp16");
  // libtorch 1.13 disables CPU autocast for any dtype but bf16 (with a warning only).
  TORCH_CHECK(device_type != c10::DeviceType::CPU || dtype == at::kBFloat16,
              "fp16 autocast is not available on the CPU: paratrain casts CPU operations to bf16 "
              "only, as libtorch 1.13 does (CPUs have no fast fp16 arithmetic); use bf16, "
              "which has fp32's range and needs no loss scaling");
}

at::ScalarType parse_dtype(const std::string& name) {
  std::string n;
  for (char c : name) {
    n.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  if (n == "bf16" || n == "bfloat16") {
    return at::kBFloat16;
  }
  if (n == "fp16" || n == "float16" || n == "half") {
    return at::kHalf;
  }
  TORCH_CHECK(false, "unknown mixed-precision dtype '", name, "': choose bf16 or fp16");
}

Autocast::Autocast(c10::DeviceType device_type, c10::optional<at::ScalarType> dtype, bool enabled)
    : device_type_(device_type), entered_(false) {
  const at::ScalarType want = dtype.value_or(default_dtype(device_type));
  if (enabled) {
    check_autocast_supported(device_type, want);
    if (device_type == c10::DeviceType::CPU) {
      cpu::ensure_bf16_convolutions();  // Note [CPU kernels that do not run]
    }
  }
  previous_enabled_ = detail::autocast_enabled(device_type);
  previous_dtype_ = detail::autocast_dtype(device_type);
  // The dtype first (libtorch refuses some on the CPU), and only when enabling: a disabled
  // region keeps the enclosing dtype, and a refused one changes nothing.
  if (enabled) {
    detail::set_autocast_dtype(device_type, want);
  }
  detail::set_autocast_enabled(device_type, enabled);
  at::autocast::increment_nesting();
  entered_ = true;
}

Autocast::~Autocast() {
  if (!entered_) {
    return;
  }
  // As torch.autocast's __exit__: the cast weights cached for this region go with the outermost
  // region.
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  detail::set_autocast_enabled(device_type_, previous_enabled_);
  detail::set_autocast_dtype(device_type_, previous_dtype_);
}

}  // namespace amp
}  // namespace paratrain
