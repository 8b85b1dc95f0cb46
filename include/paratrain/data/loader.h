#pragma once

// A batch loader over in-memory tensors with worker threads and prefetching: the part of
// torch.utils.data.DataLoader that a C++ trainer needs. Batches come in sampler order; workers
// assemble the next ones while the trainer computes, and with pin_memory (when the target device
// is CUDA) they land in page-locked memory so host-to-device copies can be asynchronous.
//
//   TensorLoader loader(train.images(), train.targets(), sampler.indices(),
//                       LoaderOptions(64).workers(2).pin_memory(device.is_cuda()));
//   while (auto batch = loader.next()) { ... batch->data, batch->target ... }
//
// Threads: next() is called by one consumer thread; workers only read the source tensors.

#include <torch/arg.h>
#include <torch/types.h>

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace paratrain {
namespace data {

struct LoaderOptions {
  explicit LoaderOptions(size_t batch_size) : batch_size_(batch_size) {}
  /// Samples per batch.
  TORCH_ARG(size_t, batch_size);
  /// Background threads assembling batches; 0 assembles them in next().
  TORCH_ARG(size_t, workers) = 0;
  /// Batches each worker may have ready ahead of the consumer.
  TORCH_ARG(size_t, prefetch_factor) = 2;
  /// Page-locked batches (only meaningful with CUDA; ignored without it).
  TORCH_ARG(bool, pin_memory) = false;
  /// Drop a last batch smaller than batch_size.
  TORCH_ARG(bool, drop_last) = false;
};

struct Batch {
  torch::Tensor data;
  torch::Tensor target;
};

class TensorLoader {
 public:
  TensorLoader(torch::Tensor data,
               torch::Tensor targets,
               std::vector<size_t> indices,
               LoaderOptions options);
  ~TensorLoader();
  TensorLoader(const TensorLoader&) = delete;
  TensorLoader& operator=(const TensorLoader&) = delete;

  /// The next batch in order, or nullopt at the end.
  std::optional<Batch> next();
  size_t num_batches() const { return num_batches_; }

 private:
  Batch make(size_t batch) const;
  void work(size_t worker);

  torch::Tensor data_;
  torch::Tensor targets_;
  std::vector<size_t> indices_;
  LoaderOptions options_;
  size_t num_batches_ = 0;
  size_t next_ = 0;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<size_t, Batch> ready_;  // guarded by mutex_
  std::exception_ptr error_;       // guarded by mutex_: a worker's failure, rethrown by next()
  bool stop_ = false;              // guarded by mutex_
  std::vector<std::thread> threads_;
};

}  // namespace data
}  // namespace paratrain
