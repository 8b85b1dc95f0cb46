#pragma once

// DistributedSampler: each rank's share of a dataset, index for index the sequence of PyTorch's
// torch.utils.data.DistributedSampler (torch/utils/data/distributed.py), so runs can be compared
// with PyTorch sample by sample:
//   - shuffle: torch.randperm(size) with a CPU generator seeded seed + epoch (libtorch's randperm
//     is the same code as PyTorch's), else 0 .. size-1;
//   - drop_last false: pad by repeating indices from the start up to a multiple of num_replicas;
//     drop_last true: cut the tail to a multiple of num_replicas;
//   - rank r takes every num_replicas-th index starting at r.
//
//   paratrain::data::DistributedSampler sampler(train.size(), pg->size(), pg->rank());
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);   // as in PyTorch: otherwise every epoch has the same order
//     for (size_t i : sampler.indices()) { ... }
//   }
//
// It is also an IndexSampler for paratrain's DataLoader (which calls set_epoch for each epoch) and
// a torch::data sampler (reset/next), so it plugs into libtorch's data loaders.

#include "paratrain/data/sampler.h"

#include <torch/data/samplers/base.h>

#include <cstdint>
#include <vector>

namespace paratrain {
namespace data {

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>>,
                           public IndexSampler {
 public:
  /// Throws c10::Error for num_replicas < 1 or rank outside [0, num_replicas).
  DistributedSampler(size_t size,
                     int num_replicas,
                     int rank,
                     bool shuffle = true,
                     uint64_t seed = 0,
                     bool drop_last = false);

  /// torchelastic's ElasticDistributedSampler start_index: the first `start` indices of the
  /// epoch's order are taken as done (by an earlier world), and the rest is padded and shared out
  /// over this world as usual. Applies to the epochs built after it until set back to 0.
  void set_start_index(size_t start);
  size_t start_index() const { return start_; }

  /// Picks the epoch's order (seed + epoch) and rewinds.
  void set_epoch(uint64_t epoch);
  uint64_t epoch() const { return epoch_; }

  /// This rank's indices for the current epoch.
  const std::vector<size_t>& indices() const { return indices_; }
  /// Samples per rank per epoch (PyTorch's len(sampler)).
  size_t num_samples() const { return num_samples_; }
  /// num_samples() * num_replicas.
  size_t total_size() const { return num_samples_ * static_cast<size_t>(num_replicas_); }

  /// IndexSampler: set_epoch(epoch), then indices(). The DataLoader calls it at each epoch.
  std::vector<size_t> epoch_indices(uint64_t epoch) override;

  // torch::data::samplers::Sampler
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void build();

  size_t size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  uint64_t epoch_ = 0;
  size_t start_ = 0;
  size_t num_samples_ = 0;
  std::vector<size_t> indices_;
  size_t position_ = 0;
};

}  // namespace data
}  // namespace paratrain
