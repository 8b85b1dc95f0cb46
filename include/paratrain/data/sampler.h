#pragma once

// Index samplers: the order of a dataset's indices in each epoch, for the DataLoader (loader.h).
// DistributedSampler (distributed_sampler.h) is one too.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace paratrain {
namespace data {

/// The order of a dataset's indices in each epoch (DistributedSampler is one).
class IndexSampler {
 public:
  virtual ~IndexSampler() = default;
  virtual std::vector<size_t> epoch_indices(uint64_t epoch) = 0;
};

/// 0 .. size-1 (torch.utils.data.SequentialSampler).
class SequentialSampler : public IndexSampler {
 public:
  explicit SequentialSampler(size_t size) : size_(size) {}
  std::vector<size_t> epoch_indices(uint64_t epoch) override;

 private:
  size_t size_;
};

/// torch.randperm(size) from a CPU generator seeded seed + epoch (as DistributedSampler shuffles).
class RandomSampler : public IndexSampler {
 public:
  RandomSampler(size_t size, uint64_t seed) : size_(size), seed_(seed) {}
  std::vector<size_t> epoch_indices(uint64_t epoch) override;

 private:
  size_t size_;
  uint64_t seed_;
};

/// The same given indices every epoch.
class FixedSampler : public IndexSampler {
 public:
  explicit FixedSampler(std::vector<size_t> indices) : indices_(std::move(indices)) {}
  std::vector<size_t> epoch_indices(uint64_t) override { return indices_; }

 private:
  std::vector<size_t> indices_;
};

}  // namespace data
}  // namespace paratrain
