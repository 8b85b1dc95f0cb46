#include "paratrain/data/device_prefetcher.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <utility>

namespace paratrain {
namespace data {

// Device-generic streams and events (c10::impl::VirtualGuardImpl) rather than c10::cuda's: the
// same code builds against a CPU-only libtorch, where it is never asked for a stream.
DevicePrefetcher::DevicePrefetcher(BatchSource& loader, torch::Device device, Transform transform)
    : loader_(loader), device_(device), transform_(std::move(transform)) {
  if (device_.is_cuda()) {
    if (!device_.has_index()) {
      device_ = torch::Device(torch::kCUDA,
                              c10::impl::VirtualGuardImpl(device_.type()).getDevice().index());
    }
    stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_);
    prefetch();
  }
}

void DevicePrefetcher::prefetch() {
  pending_.reset();
  ready_.reset();
  std::optional<Batch> batch;
  try {
    batch = loader_.next();
  } catch (...) {
    // Handed to the next call of next(), after the batch already taken is returned.
    error_ = std::current_exception();
    return;
  }
  if (!batch) {
    return;
  }
  try {
    c10::StreamGuard on_side(*stream_);
    // The copy reads pinned memory asynchronously; the side stream orders the transform after it.
    batch->data = batch->data.to(device_, /*non_blocking=*/true);
    batch->target = batch->target.to(device_, /*non_blocking=*/true);
    if (transform_) {
      batch->data = transform_(batch->data);
    }
    c10::Event ready(device_.type());
    ready.record(*stream_);
    ready_.emplace(std::move(ready));
    pending_ = std::move(batch);
  } catch (...) {
    error_ = std::current_exception();
  }
}

std::optional<Batch> DevicePrefetcher::next() {
  if (!stream_) {
    auto batch = loader_.next();
    if (batch) {
      batch->data = batch->data.to(device_);
      batch->target = batch->target.to(device_);
      if (transform_) {
        batch->data = transform_(batch->data);
      }
    }
    return batch;
  }
  if (error_) {
    std::exception_ptr error = std::exchange(error_, nullptr);
    std::rethrow_exception(error);
  }
  if (!pending_) {
    return std::nullopt;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  const c10::Stream compute = impl.getStream(device_);
  ready_->block(compute);
  Batch out = std::move(*pending_);
  pending_.reset();
  // Memory made on the side stream is used on the compute stream: tell the caching allocator, so
  // it is not handed out again before the compute stream is done with it.
  out.data.record_stream(compute);
  out.target.record_stream(compute);
  prefetch();
  return out;
}

}  // namespace data
}  // namespace paratrain
