// libFuzzer target: the safetensors reader on raw bytes. Rejected input must throw; the tensors
// it returns must be contiguous and no larger than the input, their bools 0 or 1.

#include "paratrain/io/safetensors.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <exception>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, torch::Tensor> tensors;
  try {
    tensors = paratrain::load_safetensors_bytes(data, size, "fuzz input");
  } catch (const std::exception&) {
    return 0;  // c10::Error (or another std::exception): rejected, as it should be
  }
  for (const auto& kv : tensors) {
    const torch::Tensor& t = kv.second;
    if (!t.defined() || !t.is_contiguous() || t.nbytes() > size) {
      std::abort();
    }
    if (t.scalar_type() == torch::kBool) {
      // Read here, where UBSan checks that every bool is 0 or 1.
      const bool* b = t.data_ptr<bool>();
      volatile int set = 0;
      for (int64_t i = 0; i < t.numel(); ++i) {
        set = set + (b[i] ? 1 : 0);
      }
    }
  }
  return 0;
}
