#pragma once

// Internal: the per-thread autocast flags and dtypes of one device type, over libtorch's two APIs.
// libtorch 2.4 added the device-type functions (at::autocast::is_autocast_enabled(device_type)
// and friends) and deprecated the per-device ones (is_enabled, is_cpu_enabled,
// get_autocast_gpu_dtype, ...), which then warn at every call; 1.13 to 2.3 have only the latter.
// Chosen at compile time, so no build calls a deprecated function.

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define PARATRAIN_AUTOCAST_DEVICE_TYPE_API 1
#else
#define PARATRAIN_AUTOCAST_DEVICE_TYPE_API 0
#endif

namespace paratrain {
namespace amp {
namespace detail {

// Only CPU and CUDA reach these (check_autocast_supported).
inline bool autocast_enabled(c10::DeviceType type) {
#if PARATRAIN_AUTOCAST_DEVICE_TYPE_API
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
#if PARATRAIN_AUTOCAST_DEVICE_TYPE_API
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType type) {
#if PARATRAIN_AUTOCAST_DEVICE_TYPE_API
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                      : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType type, at::ScalarType dtype) {
#if PARATRAIN_AUTOCAST_DEVICE_TYPE_API
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

}  // namespace detail
}  // namespace amp
}  // namespace paratrain
