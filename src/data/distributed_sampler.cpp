#include "paratrain/data/distributed_sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

namespace paratrain {
namespace data {

DistributedSampler::DistributedSampler(
    size_t size, int num_replicas, int rank, bool shuffle, uint64_t seed, bool drop_last)
    : size_(size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  TORCH_CHECK(num_replicas >= 1, "DistributedSampler: num_replicas must be at least 1, got ",
              num_replicas);
  TORCH_CHECK(rank >= 0 && rank < num_replicas, "DistributedSampler: invalid rank ", rank,
              ", rank should be in the interval [0, ", num_replicas - 1, "]");
  build();
}

void DistributedSampler::set_epoch(uint64_t epoch) {
  epoch_ = epoch;
  build();
}

std::vector<size_t> DistributedSampler::epoch_indices(uint64_t epoch) {
  set_epoch(epoch);
  return indices_;
}

void DistributedSampler::build() {
  std::vector<size_t> all;
  all.reserve(size_);
  if (shuffle_) {
    auto gen = at::detail::createCPUGenerator(seed_ + epoch_);
    at::Tensor perm = torch::randperm(static_cast<int64_t>(size_), gen, torch::kLong);
    const int64_t* p = perm.data_ptr<int64_t>();
    all.assign(p, p + size_);
  } else {
    for (size_t i = 0; i < size_; ++i) {
      all.push_back(i);
    }
  }
  // ElasticDistributedSampler: what an earlier world already took is not shared out again.
  all.erase(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(std::min(start_, all.size())));
  const size_t n = all.size();
  const size_t replicas = static_cast<size_t>(num_replicas_);
  // PyTorch: with drop_last and an uneven split, ceil((n - replicas) / replicas) samples each
  // (the tail is dropped); else ceil(n / replicas) (the tail is padded).
  if (drop_last_ && n % replicas != 0) {
    num_samples_ = n >= replicas ? (n - replicas + replicas - 1) / replicas : 0;
  } else {
    num_samples_ = (n + replicas - 1) / replicas;
  }
  const size_t total = num_samples_ * replicas;
  if (!drop_last_) {
    // Repeat from the start (several times over when the dataset is smaller than the padding).
    for (size_t i = 0; all.size() < total && n > 0; i = (i + 1) % n) {
      all.push_back(all[i]);
    }
  } else {
    all.resize(total);
  }
  indices_.clear();
  for (size_t i = static_cast<size_t>(rank_); i < total; i += replicas) {
    indices_.push_back(all[i]);
  }
  position_ = 0;
}

void DistributedSampler::set_start_index(size_t start) {
  start_ = start;
  build();
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size.has_value() && *new_size != size_) {
    size_ = *new_size;
    build();
  }
  position_ = 0;
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (position_ >= indices_.size()) {
    return c10::nullopt;
  }
  size_t end = std::min(indices_.size(), position_ + batch_size);
  std::vector<size_t> batch(indices_.begin() + static_cast<long>(position_),
                            indices_.begin() + static_cast<long>(end));
  position_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", torch::tensor(static_cast<int64_t>(epoch_)), /*is_buffer=*/true);
  archive.write("position", torch::tensor(static_cast<int64_t>(position_)), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor epoch = torch::empty({}, torch::kLong);
  torch::Tensor position = torch::empty({}, torch::kLong);
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  set_epoch(static_cast<uint64_t>(epoch.item<int64_t>()));
  position_ = static_cast<size_t>(position.item<int64_t>());
}

}  // namespace data
}  // namespace paratrain
