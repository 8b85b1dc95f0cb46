#pragma once

// DataLoader: torch.utils.data.DataLoader for map-style datasets, with worker threads instead of
// worker processes. An index sampler orders each epoch; workers build whole batches (get() per
// index, or the dataset's get_batch), collate them, optionally into pinned memory, and keep up to
// prefetch_factor batches each ready ahead of the consumer; next() hands them out in order.
//
//   auto train = std::make_shared<data::ImageFolder>(dir + "/train", train_transform);
//   data::DataLoader loader(train, data::LoaderOptions(64).workers(4).shuffle(true).seed(0));
//   for (uint64_t epoch = 0; epoch < epochs; ++epoch) {
//     loader.set_epoch(epoch);      // as DistributedSampler.set_epoch: each epoch its own order
//     while (auto batch = loader.next()) { ... batch->data, batch->target ... }
//   }
//
// Randomness: shuffling draws from seed + epoch, and each sample's random transforms from
// (seed, epoch, its position in the epoch, its index), so the same seed gives the same batches on
// every run whatever the number of workers; the index makes DDP ranks, whose positions coincide,
// draw different crops.
//
// Errors: a sample that fails (a corrupt file, a transform that cannot apply) throws from next()
// a c10::Error naming the sample's index and file, and the epoch's pass ends there. With
// skip_bad_samples the sample is left out of its batch instead, counted in bad_samples(), and
// reported on stderr once, at the end of the epoch.
//
// Threads: one consumer thread calls next() and the other members.

#include "paratrain/data/dataset.h"
#include "paratrain/data/sampler.h"

#include <torch/arg.h>
#include <torch/types.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace data {

struct LoaderOptions {
  explicit LoaderOptions(size_t batch_size) : batch_size_(batch_size) {}
  /// Samples per batch.
  TORCH_ARG(size_t, batch_size);
  /// Worker threads building batches; 0 builds them in next(). Negative is an error.
  TORCH_ARG(int64_t, workers) = 0;
  /// Batches each worker may have ready ahead of the consumer.
  TORCH_ARG(size_t, prefetch_factor) = 2;
  /// Batches in page-locked memory (CUDA builds with a GPU; ignored otherwise), so that copies to
  /// the GPU can be asynchronous (DevicePrefetcher).
  TORCH_ARG(bool, pin_memory) = false;
  /// Drop a last batch smaller than batch_size.
  TORCH_ARG(bool, drop_last) = false;
  /// Without a sampler: a new random order each epoch (RandomSampler(seed)), else in order.
  TORCH_ARG(bool, shuffle) = false;
  /// Seeds shuffling and the samples' random transforms.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Keep the worker threads between epochs instead of starting them for each.
  TORCH_ARG(bool, persistent_workers) = false;
  /// Leave out samples that fail (counted, reported once per epoch) instead of throwing.
  TORCH_ARG(bool, skip_bad_samples) = false;
};

struct BadSample {
  size_t index;
  std::string what;   // the dataset's describe(index), e.g. the file
  std::string error;  // the reason
};

struct LoaderStats {
  /// Seconds next() spent waiting for a batch (all the loading time, with 0 workers): when it is
  /// a large share of a step, training is input-bound.
  double wait_seconds = 0;
  size_t batches = 0;
  size_t samples = 0;
};

/// Anything that hands out batches in order (DevicePrefetcher reads one).
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  /// The next batch, or nullopt at the end of the epoch.
  virtual std::optional<Batch> next() = 0;
};

class DataLoader : public BatchSource {
 public:
  /// Without a sampler: RandomSampler(size, seed) with shuffle, else SequentialSampler. Throws
  /// for batch_size 0, workers < 0, or shuffle together with a sampler (as PyTorch).
  DataLoader(DatasetPtr dataset,
             LoaderOptions options,
             std::shared_ptr<IndexSampler> sampler = nullptr);
  ~DataLoader() override;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Ends any pass under way; the next call to next() starts epoch `epoch`'s pass, at batch
  /// `start_batch` (a resumed epoch: the batches before it are neither loaded nor returned).
  void set_epoch(uint64_t epoch, size_t start_batch = 0);
  uint64_t epoch() const { return epoch_; }

  /// The next batch of the current epoch (starting its pass on the first call), or nullopt once
  /// the epoch is over, until set_epoch() starts another.
  std::optional<Batch> next() override;

  /// Batches in an epoch of `samples` indices.
  size_t num_batches(size_t samples) const;
  /// Batches in the current epoch (its indices are drawn when it starts).
  size_t num_batches();

  const LoaderStats& stats() const { return stats_; }
  void reset_stats() { stats_ = LoaderStats(); }
  /// Every sample left out so far (skip_bad_samples).
  std::vector<BadSample> bad_samples() const;
  const LoaderOptions& options() const { return options_; }
  Dataset& dataset() { return *dataset_; }

 private:
  struct Job {
    size_t batch;
    uint64_t pass;
    uint64_t epoch;
    std::vector<size_t> indices;
  };
  // Builds batch `job.batch`; empty data when every sample was skipped.
  Batch build(const Job& job, std::vector<BadSample>& bad);
  Sample get_one(size_t index, uint64_t epoch, size_t position, std::vector<BadSample>& bad);
  void begin_pass();
  void end_pass();
  void start_workers();
  void stop_workers();
  void work();
  std::optional<Job> take_job(std::unique_lock<std::mutex>& lock);

  DatasetPtr dataset_;
  LoaderOptions options_;
  std::shared_ptr<IndexSampler> sampler_;
  uint64_t epoch_ = 0;  // written by the consumer under mutex_
  LoaderStats stats_;

  // The pass: written by the consumer under mutex_, read by workers under it.
  enum class State { kIdle, kRunning, kDone } state_ = State::kIdle;
  std::vector<size_t> indices_;
  size_t num_batches_ = 0;
  size_t start_batch_ = 0;  // set_epoch's: where the next pass begins
  size_t next_ = 0;         // the batch next() returns next
  size_t issued_ = 0;       // the next batch a worker takes
  uint64_t pass_ = 0;       // increments at each pass, so late results of an ended one are dropped
  size_t reported_bad_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::map<size_t, Batch> ready_;                // guarded by mutex_
  std::map<size_t, std::exception_ptr> failed_;  // guarded by mutex_
  std::vector<BadSample> bad_;                   // guarded by mutex_
  std::exception_ptr fatal_;                     // guarded by mutex_: a result that was lost
  bool stop_ = false;                            // guarded by mutex_
  std::vector<std::thread> threads_;
};

/// In-memory tensors through the DataLoader: a TensorDataset read in the given order, once.
class TensorLoader : public BatchSource {
 public:
  TensorLoader(torch::Tensor data,
               torch::Tensor targets,
               std::vector<size_t> indices,
               LoaderOptions options);
  std::optional<Batch> next() override { return loader_.next(); }
  size_t num_batches() { return loader_.num_batches(); }
  const LoaderStats& stats() const { return loader_.stats(); }

 private:
  DataLoader loader_;
};

}  // namespace data
}  // namespace paratrain
