#pragma once

// Autocast: libtorch's automatic mixed precision, as an RAII guard (torch.autocast in C++).
//
//   {
//     paratrain::amp::Autocast autocast(torch::kCPU);   // bf16 on CPU, fp16 on CUDA by default
//     auto loss = loss_fn(model->forward(x), y);      // matmuls and convolutions in bf16
//   }
//   loss.backward();                                  // outside the guard, as in PyTorch
//
// libtorch 1.13's CPU autocast knows bf16 only; fp16 on the CPU is refused with an error that
// says to use bf16. The state is per thread, as in PyTorch; paratrain's DataParallel and Pipeline
// threads take the caller's (enabled flags and dtypes) and open an autocast region of their own
// per task, so their cast caches never outlive a forward.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <string>

namespace paratrain {
namespace amp {

/// The default autocast dtype of a device type: bf16 on the CPU, fp16 on CUDA.
at::ScalarType default_dtype(c10::DeviceType device_type);

/// Throws c10::Error with what to use instead when autocast cannot run `dtype` on `device_type`
/// in this libtorch build (fp16 on the CPU; a device type other than CPU and CUDA; a dtype other
/// than fp16 and bf16).
void check_autocast_supported(c10::DeviceType device_type, at::ScalarType dtype);

/// "bf16"/"bfloat16" or "fp16"/"float16"/"half"; throws c10::Error for anything else.
at::ScalarType parse_dtype(const std::string& name);

class Autocast {
 public:
  explicit Autocast(c10::DeviceType device_type,
                    c10::optional<at::ScalarType> dtype = c10::nullopt,
                    bool enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  at::ScalarType previous_dtype_;
  bool entered_;
};

}  // namespace amp
}  // namespace paratrain
