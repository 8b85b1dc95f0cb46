#include "paratrain/data/loader.h"

#include <torch/cuda.h>
#include <torch/torch.h>

namespace paratrain {
namespace data {

TensorLoader::TensorLoader(torch::Tensor data,
                           torch::Tensor targets,
                           std::vector<size_t> indices,
                           LoaderOptions options)
    : data_(std::move(data)),
      targets_(std::move(targets)),
      indices_(std::move(indices)),
      options_(std::move(options)) {
  TORCH_CHECK(options_.batch_size() > 0, "batch size must be positive, got ",
              options_.batch_size());
  TORCH_CHECK(data_.size(0) == targets_.size(0), "loader: ", data_.size(0), " samples but ",
              targets_.size(0), " targets");
  const size_t b = options_.batch_size();
  num_batches_ = options_.drop_last() ? indices_.size() / b : (indices_.size() + b - 1) / b;
  if (!torch::cuda::is_available()) {
    options_.pin_memory(false);
  }
  for (size_t w = 0; w < options_.workers(); ++w) {
    threads_.emplace_back([this, w] { work(w); });
  }
}

TensorLoader::~TensorLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    t.join();
  }
}

Batch TensorLoader::make(size_t batch) const {
  const size_t b = options_.batch_size();
  const size_t begin = batch * b;
  const size_t end = std::min(indices_.size(), begin + b);
  std::vector<int64_t> pick(indices_.begin() + static_cast<long>(begin),
                            indices_.begin() + static_cast<long>(end));
  torch::Tensor idx = torch::tensor(pick, torch::kLong);
  Batch out{data_.index_select(0, idx), targets_.index_select(0, idx)};
  if (options_.pin_memory()) {
    out.data = out.data.pin_memory();
    out.target = out.target.pin_memory();
  }
  return out;
}

void TensorLoader::work(size_t worker) {
  // Worker w builds batches w, w + workers, ...; it stays at most prefetch_factor * workers
  // batches ahead of the consumer so memory stays bounded.
  const size_t stride = options_.workers();
  const size_t ahead = std::max<size_t>(1, options_.prefetch_factor()) * stride;
  for (size_t batch = worker; batch < num_batches_; batch += stride) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || batch < next_ + ahead; });
      if (stop_) {
        return;
      }
    }
    try {
      Batch b = make(batch);
      std::lock_guard<std::mutex> lock(mutex_);
      ready_.emplace(batch, std::move(b));
    } catch (...) {
      // An exception must not escape the thread (std::terminate): hand it to the consumer.
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) {
        error_ = std::current_exception();
      }
    }
    cv_.notify_all();
  }
}

std::optional<Batch> TensorLoader::next() {
  if (next_ >= num_batches_) {
    return std::nullopt;
  }
  if (threads_.empty()) {
    return make(next_++);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return ready_.count(next_) > 0 || error_; });
  if (!ready_.count(next_)) {
    std::rethrow_exception(error_);
  }
  Batch b = std::move(ready_[next_]);
  ready_.erase(next_);
  ++next_;
  lock.unlock();
  cv_.notify_all();
  return b;
}

}  // namespace data
}  // namespace paratrain
