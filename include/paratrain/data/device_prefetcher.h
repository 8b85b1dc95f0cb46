#pragma once

// Batches moved to the training device ahead of time: while the model computes on batch i, batch
// i + 1 is copied from pinned host memory and transformed (e.g. resized) on a side stream of the
// device, as the prefetching loaders of PyTorch's ImageNet examples do. The step that takes a
// batch waits only for that batch's copy, on the device, never on the host.
//
//   data::DataLoader loader(dataset, LoaderOptions(64).workers(2).pin_memory(true));
//   data::DevicePrefetcher batches(loader, torch::Device("cuda:0"),
//       [](const torch::Tensor& x) { return data::adapt_images(x, 224, 3); });
//   while (auto batch = batches.next()) { ... batch->data, batch->target on cuda:0 ... }
//
// On the CPU (or any device without streams) it copies and transforms in next(), in order.
// Threads: one consumer thread calls next().

#include "paratrain/data/loader.h"

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>
#include <torch/types.h>

#include <exception>
#include <functional>
#include <optional>

namespace paratrain {
namespace data {

class DevicePrefetcher {
 public:
  /// Applied to each batch's data on the device (after the copy), on the side stream.
  using Transform = std::function<torch::Tensor(const torch::Tensor&)>;

  DevicePrefetcher(BatchSource& loader, torch::Device device, Transform transform = nullptr);
  DevicePrefetcher(const DevicePrefetcher&) = delete;
  DevicePrefetcher& operator=(const DevicePrefetcher&) = delete;

  /// The next batch, on the device and transformed, or nullopt at the end. Work queued on the
  /// device's current stream after this call sees the batch complete.
  std::optional<Batch> next();

 private:
  // Starts the copy and transform of the loader's next batch on the side stream.
  void prefetch();

  BatchSource& loader_;
  torch::Device device_;
  Transform transform_;
  c10::optional<c10::Stream> stream_;  // the side stream (CUDA only)
  std::optional<Batch> pending_;       // copied (or being copied) on stream_
  std::optional<c10::Event> ready_;    // recorded on stream_ after pending_'s work
  std::exception_ptr error_;           // a failed prefetch, rethrown by the next next()
};

}  // namespace data
}  // namespace paratrain
