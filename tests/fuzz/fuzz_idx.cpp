// libFuzzer target: Fashion-MNIST's idx reader, on gzip'd and plain bytes, read both as an image
// file and as a label file. Rejected input must throw; anything it returns must be what the reader
// promises.

#include "paratrain/data/fashion_mnist.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <exception>

namespace {

void read_as(const uint8_t* data, size_t size, bool images) {
  torch::Tensor t;
  try {
    t = paratrain::data::read_idx_bytes(data, size, images, "fuzz input");
  } catch (const std::exception&) {
    return;  // c10::Error (or another std::exception): rejected, as it should be
  }
  // uint8 shaped [N, 28, 28] or [N], holding no more bytes than gzip could inflate from the input.
  const bool shaped = images ? t.dim() == 3 && t.size(1) == 28 && t.size(2) == 28 : t.dim() == 1;
  if (t.scalar_type() != torch::kUInt8 || !shaped || !t.is_contiguous() ||
      t.nbytes() > size * 1032 + 16) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  read_as(data, size, true);
  read_as(data, size, false);
  return 0;
}
