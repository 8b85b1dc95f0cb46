#include "paratrain/data/loader.h"

#include "base/errors.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>

namespace paratrain {
namespace data {

// ---- samplers -----------------------------------------------------------------------------------

std::vector<size_t> SequentialSampler::epoch_indices(uint64_t) {
  std::vector<size_t> out(size_);
  for (size_t i = 0; i < size_; ++i) {
    out[i] = i;
  }
  return out;
}

std::vector<size_t> RandomSampler::epoch_indices(uint64_t epoch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ + epoch);
  torch::Tensor perm = torch::randperm(static_cast<int64_t>(size_), gen, torch::kLong);
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<size_t>(p, p + size_);
}

// ---- DataLoader ---------------------------------------------------------------------------------

DataLoader::DataLoader(DatasetPtr dataset,
                       LoaderOptions options,
                       std::shared_ptr<IndexSampler> sampler)
    : dataset_(std::move(dataset)), options_(std::move(options)), sampler_(std::move(sampler)) {
  TORCH_CHECK(dataset_ != nullptr, "DataLoader: the dataset is null");
  TORCH_CHECK(options_.batch_size() > 0, "DataLoader: batch_size must be positive, got ",
              options_.batch_size());
  TORCH_CHECK(options_.workers() >= 0, "DataLoader: workers must be >= 0, got ", options_.workers(),
              " (0 loads in the training thread)");
  TORCH_CHECK(!(sampler_ && options_.shuffle()),
              "DataLoader: sampler option is mutually exclusive with shuffle (the sampler sets "
              "the order; shuffle it there)");
  if (!sampler_) {
    if (options_.shuffle()) {
      sampler_ = std::make_shared<RandomSampler>(dataset_->size(), options_.seed());
    } else {
      sampler_ = std::make_shared<SequentialSampler>(dataset_->size());
    }
  }
  if (!torch::cuda::is_available()) {
    options_.pin_memory(false);
  }
}

DataLoader::~DataLoader() {
  stop_workers();
}

size_t DataLoader::num_batches(size_t samples) const {
  const size_t b = options_.batch_size();
  return options_.drop_last() ? samples / b : (samples + b - 1) / b;
}

size_t DataLoader::num_batches() {
  if (state_ == State::kIdle) {
    begin_pass();
  }
  return num_batches_;
}

void DataLoader::set_epoch(uint64_t epoch, size_t start_batch) {
  if (state_ != State::kIdle) {
    end_pass();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  epoch_ = epoch;
  start_batch_ = start_batch;
  state_ = State::kIdle;
}

std::vector<BadSample> DataLoader::bad_samples() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bad_;
}

void DataLoader::begin_pass() {
  std::vector<size_t> indices = sampler_->epoch_indices(epoch_);
  const size_t n = dataset_->size();
  for (size_t i : indices) {
    TORCH_CHECK(i < n, "DataLoader: the sampler gave index ", i, " for a dataset of ", n,
                " samples");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    indices_ = std::move(indices);
    num_batches_ = num_batches(indices_.size());
    // A resumed epoch starts where its checkpoint stopped. Each sample's seed depends on its
    // position, not on what came before, so the batches that follow are the same ones.
    next_ = std::min(start_batch_, num_batches_);
    issued_ = next_;
    start_batch_ = 0;  // the next pass of this epoch starts from its beginning
    ++pass_;
    ready_.clear();
    failed_.clear();
    fatal_ = nullptr;
    state_ = State::kRunning;
  }
  cv_.notify_all();
  if (options_.workers() > 0 && threads_.empty()) {
    start_workers();
  }
}

// Ends the pass: workers drop what they still build (their pass number is stale), non-persistent
// workers stop, and samples newly skipped are reported.
void DataLoader::end_pass() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = State::kDone;
    ++pass_;
    ready_.clear();
    failed_.clear();
    fatal_ = nullptr;
  }
  cv_.notify_all();
  if (!options_.persistent_workers()) {
    stop_workers();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (bad_.size() > reported_bad_) {
    std::cerr << "DataLoader: left out " << bad_.size() - reported_bad_
              << " bad sample(s) in epoch " << epoch_ << " (skip_bad_samples):\n";
    for (size_t i = reported_bad_; i < bad_.size(); ++i) {
      std::cerr << "  sample " << bad_[i].index << " " << bad_[i].what << ": " << bad_[i].error
                << "\n";
    }
    std::cerr << std::flush;
    reported_bad_ = bad_.size();
  }
}

void DataLoader::start_workers() {
  for (int64_t w = 0; w < options_.workers(); ++w) {
    threads_.emplace_back([this] { work(); });
  }
}

void DataLoader::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    t.join();
  }
  threads_.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  stop_ = false;
}

Sample DataLoader::get_one(size_t index,
                           uint64_t epoch,
                           size_t position,
                           std::vector<BadSample>& bad) {
  seed_sample_generator(options_.seed(), epoch, position, index);
  try {
    return dataset_->get(index);
  } catch (const std::exception& e) {
    const std::string why = paratrain::detail::error_message(std::current_exception());
    const std::string what = dataset_->describe(index);
    if (options_.skip_bad_samples()) {
      bad.push_back({index, what, why});
      return {};
    }
    // The dataset's message usually names the file already; say it once.
    const bool named = what.empty() || why.find(what) != std::string::npos;
    TORCH_CHECK(false, "DataLoader: sample ", index, named ? "" : " (" + what + ")", ": ", why);
  }
  return {};  // not reached
}

Batch DataLoader::build(const Job& job, std::vector<BadSample>& bad) {
  const size_t first = job.batch * options_.batch_size();
  if (job.indices.empty()) {
    return {};
  }
  seed_sample_generator(options_.seed(), job.epoch, first, job.indices[0]);
  if (auto batch = dataset_->get_batch(job.indices)) {
    if (options_.pin_memory()) {
      batch->data = batch->data.pin_memory();
      batch->target = batch->target.pin_memory();
    }
    return std::move(*batch);
  }
  // Each sample goes into the batch as soon as it is made: a whole batch of separate samples
  // would be another batch's worth of memory in flight per worker.
  Collator collator(job.indices.size(), options_.pin_memory());
  for (size_t k = 0; k < job.indices.size(); ++k) {
    const size_t index = job.indices[k];
    Sample s = get_one(index, job.epoch, first + k, bad);
    if (!s.data.defined()) {
      continue;
    }
    try {
      collator.add(s);
    } catch (const std::exception& e) {
      if (!options_.skip_bad_samples()) {
        throw;
      }
      bad.push_back({index, dataset_->describe(index),
                     paratrain::detail::error_message(std::current_exception())});
    }
  }
  return collator.finish();  // undefined when every sample was skipped
}

// Waits for a batch to build; nullopt when the workers stop. Allocates nothing: a job taken
// must reach the consumer, as a batch or an error.
std::optional<DataLoader::Job> DataLoader::take_job(std::unique_lock<std::mutex>& lock) {
  const size_t ahead =
      std::max<size_t>(1, options_.prefetch_factor()) * static_cast<size_t>(options_.workers());
  cv_.wait(lock, [&] {
    return stop_ ||
           (state_ == State::kRunning && issued_ < num_batches_ && issued_ < next_ + ahead);
  });
  if (stop_) {
    return std::nullopt;
  }
  return Job{issued_++, pass_, epoch_, {}};
}

void DataLoader::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (auto job = take_job(lock)) {
    Batch batch;
    std::exception_ptr error;
    std::vector<BadSample> bad;
    try {
      const size_t begin = job->batch * options_.batch_size();
      const size_t end = std::min(indices_.size(), begin + options_.batch_size());
      job->indices.assign(indices_.begin() + static_cast<std::ptrdiff_t>(begin),
                          indices_.begin() + static_cast<std::ptrdiff_t>(end));
      lock.unlock();
      batch = build(*job, bad);
    } catch (...) {
      // An exception must not escape the thread (std::terminate): the consumer rethrows it.
      error = std::current_exception();
    }
    if (!lock.owns_lock()) {
      lock.lock();
    }
    if (job->pass != pass_) {
      continue;  // the pass ended (set_epoch, an error): drop what was built for it
    }
    try {
      bad_.insert(bad_.end(), bad.begin(), bad.end());
      if (error) {
        failed_.emplace(job->batch, error);
      } else {
        ready_.emplace(job->batch, std::move(batch));
      }
    } catch (...) {
      fatal_ = std::current_exception();  // out of memory: the consumer must not wait forever
    }
    cv_.notify_all();
  }
}

std::optional<Batch> DataLoader::next() {
  if (state_ == State::kIdle) {
    begin_pass();
  }
  const auto start = std::chrono::steady_clock::now();
  auto waited = [&] {
    stats_.wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  while (state_ == State::kRunning) {
    if (next_ >= num_batches_) {
      end_pass();
      waited();
      return std::nullopt;
    }
    Batch batch;
    if (threads_.empty()) {
      try {
        const size_t begin = next_ * options_.batch_size();
        const size_t end = std::min(indices_.size(), begin + options_.batch_size());
        std::vector<BadSample> bad;
        batch = build(Job{next_,
                          pass_,
                          epoch_,
                          {indices_.begin() + static_cast<std::ptrdiff_t>(begin),
                           indices_.begin() + static_cast<std::ptrdiff_t>(end)}},
                      bad);
        std::lock_guard<std::mutex> lock(mutex_);
        bad_.insert(bad_.end(), bad.begin(), bad.end());
      } catch (...) {
        end_pass();
        throw;
      }
      ++next_;
    } else {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] {
        return ready_.count(next_) > 0 || failed_.count(next_) > 0 || fatal_ != nullptr;
      });
      auto failed = failed_.find(next_);
      if (failed != failed_.end() || (fatal_ && ready_.count(next_) == 0)) {
        std::exception_ptr error = failed != failed_.end() ? failed->second : fatal_;
        lock.unlock();
        end_pass();
        std::rethrow_exception(error);
      }
      batch = std::move(ready_[next_]);
      ready_.erase(next_);
      ++next_;
      lock.unlock();
      cv_.notify_all();
    }
    if (batch.data.defined()) {  // else every sample of it was skipped
      waited();
      ++stats_.batches;
      stats_.samples += static_cast<size_t>(batch.data.size(0));
      return batch;
    }
  }
  waited();
  return std::nullopt;
}

// ---- TensorLoader -------------------------------------------------------------------------------

TensorLoader::TensorLoader(torch::Tensor data,
                           torch::Tensor targets,
                           std::vector<size_t> indices,
                           LoaderOptions options)
    : loader_(std::make_shared<TensorDataset>(std::move(data), std::move(targets)),
              std::move(options),
              std::make_shared<FixedSampler>(std::move(indices))) {}

}  // namespace data
}  // namespace paratrain
