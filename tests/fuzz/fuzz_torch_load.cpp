// libFuzzer target: the torch.save loader.
//
// Input that starts like a zip archive ("PK\3\4") is read as a whole torch.save file. Anything
// else is taken as the pickle (data.pkl) of one: the target wraps it into an archive with
// libtorch's own writer, next to storages "0" to "7" of 256 bytes each, so that mutations reach
// the unpickler instead of failing the zip's CRC checks.
//
// Rejected input must throw. Every tensor returned must lie inside memory it owns: the target
// reads its first and last element, which AddressSanitizer checks, and its bools, which
// UBSan checks are 0 or 1.

#include "paratrain/io/torch_load.h"

#include <ATen/Parallel.h>
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

constexpr int kStorages = 8;
constexpr size_t kStorageBytes = 256;

std::vector<char> wrap_pickle(const uint8_t* data, size_t size) {
  std::vector<char> zip;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* buf, size_t n) {
    zip.insert(zip.end(), static_cast<const char*>(buf), static_cast<const char*>(buf) + n);
    return n;
  });
  writer.writeRecord("data.pkl", data, size);
  std::vector<unsigned char> storage(kStorageBytes);
  for (int k = 0; k < kStorages; ++k) {
    for (size_t i = 0; i < kStorageBytes; ++i) {
      storage[i] = static_cast<unsigned char>(k * 31 + i);
    }
    writer.writeRecord("data/" + std::to_string(k), storage.data(), storage.size());
  }
  writer.writeEndOfFile();
  return zip;
}

// Reads the lowest- and highest-addressed byte of every element range the tensor claims.
void touch(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0 || t.layout() != torch::kStrided || !t.device().is_cpu()) {
    return;
  }
  const int64_t item = static_cast<int64_t>(t.element_size());
  int64_t low = 0;   // bytes below data_ptr() (negative strides)
  int64_t high = 0;  // bytes from data_ptr() to the end of the last element
  bool overflow = __builtin_add_overflow(high, item, &high);
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t reach = 0;
    overflow |= __builtin_mul_overflow(t.size(d) - 1, t.stride(d), &reach) ||
                __builtin_mul_overflow(reach, item, &reach) ||
                __builtin_add_overflow(reach < 0 ? low : high, reach, reach < 0 ? &low : &high);
  }
  if (overflow) {
    std::fprintf(stderr, "fuzz_torch_load: a tensor of sizes %s spans more than 2^63 bytes\n",
                 c10::str(t.sizes()).c_str());
    std::abort();
  }
  const auto* base = static_cast<const volatile char*>(t.data_ptr());
  volatile char sink = base[low];
  sink = base[high - 1];
  (void)sink;
  if (t.scalar_type() == torch::kBool) {
    // Read here, where UBSan checks that every bool is 0 or 1.
    const torch::Tensor dense = t.contiguous();
    const bool* b = dense.data_ptr<bool>();
    volatile int set = 0;
    for (int64_t i = 0; i < dense.numel(); ++i) {
      set = set + (b[i] ? 1 : 0);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const bool zip = size >= 4 && std::memcmp(data, "PK\3\4", 4) == 0;
  std::map<std::string, torch::Tensor> tensors;
  try {
    if (zip) {
      tensors = paratrain::load_torch_state_dict_bytes(data, size, "fuzz input");
    } else {
      const std::vector<char> file = wrap_pickle(data, size);
      tensors = paratrain::load_torch_state_dict_bytes(file.data(), file.size(), "fuzz input");
    }
  } catch (const std::exception&) {
    return 0;  // c10::Error (or another std::exception): rejected, as it should be
  }
  for (const auto& kv : tensors) {
    touch(kv.second);
  }
  return 0;
}
