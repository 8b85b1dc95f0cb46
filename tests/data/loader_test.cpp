// The DataLoader: batches in sampler order whatever the number of workers, the same random
// transforms for the same seed whatever the number of workers, epochs, samplers, torch::data
// datasets through the adapter, a bounded prefetch, errors that name the sample, skipped samples,
// persistent workers, and the time spent waiting for data.

#include "paratrain/data/loader.h"
#include "paratrain/data/dataset.h"
#include "paratrain/data/distributed_sampler.h"
#include "paratrain/data/transforms.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace paratrain {
namespace {

using namespace testing;
namespace T = data::transforms;

std::vector<data::Batch> drain(data::DataLoader& loader) {
  std::vector<data::Batch> out;
  while (auto b = loader.next()) {
    out.push_back(*b);
  }
  return out;
}

std::shared_ptr<data::TensorDataset> numbers(int64_t n, T::TransformPtr transform = {}) {
  torch::Tensor data =
      torch::arange(n * 3 * 16 * 16).remainder(251).to(torch::kUInt8).view({n, 3, 16, 16});
  return std::make_shared<data::TensorDataset>(data, torch::arange(n), transform);
}

TEST(Loader, BatchesFollowTheSamplerWithAnyWorkerCount) {
  auto ds = numbers(23);
  for (int64_t workers : {0, 1, 3}) {
    for (bool drop_last : {false, true}) {
      SCOPED_TRACE("workers " + std::to_string(workers) + (drop_last ? ", drop_last" : ""));
      data::DataLoader loader(
          ds, data::LoaderOptions(5).workers(workers).drop_last(drop_last).shuffle(true).seed(3));
      auto batches = drain(loader);
      ASSERT_EQ(batches.size(), drop_last ? 4u : 5u);
      EXPECT_EQ(loader.num_batches(), batches.size());
      auto order = data::RandomSampler(23, 3).epoch_indices(0);
      for (size_t b = 0; b < batches.size(); ++b) {
        for (int64_t k = 0; k < batches[b].target.size(0); ++k) {
          EXPECT_EQ(batches[b].target[k].item<int64_t>(), static_cast<int64_t>(order[b * 5 + k]));
        }
      }
      EXPECT_FALSE(loader.next().has_value());  // stays at the end until set_epoch
      loader.set_epoch(1);
      auto again = drain(loader);
      ASSERT_EQ(again.size(), batches.size());
      EXPECT_FALSE(torch::equal(again[0].target, batches[0].target));  // a new order
    }
  }
}

TEST(Loader, RandomTransformsDependOnTheSeedNotTheWorkers) {
  auto transform = T::compose(T::RandomResizedCrop(8), T::RandomHorizontalFlip(), T::ToTensor());
  auto ds = numbers(40, transform);
  auto run = [&](int64_t workers, uint64_t seed, uint64_t epoch) {
    data::DataLoader loader(ds, data::LoaderOptions(6).workers(workers).seed(seed));
    loader.set_epoch(epoch);
    return torch::cat([&] {
      std::vector<torch::Tensor> parts;
      for (auto& b : drain(loader)) {
        parts.push_back(b.data);
      }
      return parts;
    }());
  };
  torch::Tensor base = run(0, 5, 0);
  EXPECT_EQ(base.sizes(), torch::IntArrayRef({40, 3, 8, 8}));
  EXPECT_TRUE(torch::equal(run(1, 5, 0), base));
  EXPECT_TRUE(torch::equal(run(4, 5, 0), base));
  EXPECT_FALSE(torch::equal(run(2, 6, 0), base));  // another seed
  EXPECT_FALSE(torch::equal(run(2, 5, 1), base));  // another epoch
}

TEST(Loader, DistributedSamplerSharesTheEpoch) {
  auto ds = numbers(10);
  std::vector<int64_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    auto sampler = std::make_shared<data::DistributedSampler>(10, 2, rank, true, 4);
    data::DataLoader loader(ds, data::LoaderOptions(2).workers(2), sampler);
    loader.set_epoch(3);
    for (auto& b : drain(loader)) {
      for (int64_t k = 0; k < b.target.size(0); ++k) {
        seen.push_back(b.target[k].item<int64_t>());
      }
    }
    EXPECT_EQ(sampler->epoch(), 3u);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_NE(error_of([&] {
              data::DataLoader bad(ds, data::LoaderOptions(2).shuffle(true),
                                   std::make_shared<data::SequentialSampler>(10));
            }).find("mutually exclusive with shuffle"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::DataLoader bad(ds, data::LoaderOptions(2).workers(-1));
            }).find("workers must be >= 0, got -1"),
            std::string::npos);
}

// A libtorch dataset as users already have them.
class Squares : public torch::data::datasets::Dataset<Squares> {
 public:
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {torch::full({2}, i * i, torch::kFloat), torch::tensor(i)};
  }
  c10::optional<size_t> size() const override { return 9; }
};

TEST(Loader, TorchDataDatasetsPlugIn) {
  data::DataLoader loader(data::from_torch(Squares()), data::LoaderOptions(4).workers(2));
  auto batches = drain(loader);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[2].data.sizes(), torch::IntArrayRef({1, 2}));
  EXPECT_EQ(batches[1].data[3][1].item<float>(), 49.0f);
  EXPECT_EQ(batches[1].target[3].item<int64_t>(), 7);
}

// Counts get() calls; index `bad` throws; each get sleeps `delay`.
class Probe : public data::Dataset {
 public:
  Probe(size_t n, size_t bad, std::chrono::milliseconds delay = {})
      : n_(n), bad_(bad), delay_(delay) {}
  size_t size() const override { return n_; }
  data::Sample get(size_t index) override {
    ++calls;
    std::this_thread::sleep_for(delay_);
    TORCH_CHECK(index != bad_, "cannot decode /data/img", index, ".jpg: truncated JPEG");
    return {torch::full({2}, static_cast<double>(index)),
            torch::tensor(static_cast<int64_t>(index))};
  }
  std::string describe(size_t index) const override {
    return "/data/img" + std::to_string(index) + ".jpg";
  }
  std::atomic<size_t> calls{0};

 private:
  size_t n_, bad_;
  std::chrono::milliseconds delay_;
};

TEST(Loader, AWorkersErrorNamesTheSampleAndEndsTheEpoch) {
  for (int64_t workers : {0, 2}) {
    auto ds = std::make_shared<Probe>(20, 13);
    data::DataLoader loader(ds, data::LoaderOptions(4).workers(workers));
    size_t good = 0;
    std::string e;
    try {
      while (loader.next()) {
        ++good;
      }
    } catch (const c10::Error& err) {
      e = err.what_without_backtrace();
    }
    EXPECT_EQ(good, 3u);  // batches 0..2; batch 3 holds index 13
    EXPECT_NE(e.find("DataLoader: sample 13: cannot decode /data/img13.jpg: truncated JPEG"),
              std::string::npos)
        << e;
    EXPECT_FALSE(loader.next().has_value());
  }
}

TEST(Loader, SkipBadSamplesLeavesThemOut) {
  auto ds = std::make_shared<Probe>(20, 13);
  data::DataLoader loader(ds, data::LoaderOptions(4).workers(2).skip_bad_samples(true));
  auto batches = drain(loader);
  ASSERT_EQ(batches.size(), 5u);
  EXPECT_EQ(batches[3].target.size(0), 3);
  auto bad = loader.bad_samples();
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].index, 13u);
  EXPECT_EQ(bad[0].what, "/data/img13.jpg");
  EXPECT_NE(bad[0].error.find("truncated JPEG"), std::string::npos);
  EXPECT_EQ(loader.stats().samples, 19u);
}

TEST(Loader, PrefetchIsBoundedAndWaitingIsMeasured) {
  auto ds = std::make_shared<Probe>(400, 1000, std::chrono::milliseconds(1));
  data::DataLoader loader(ds, data::LoaderOptions(4).workers(2).prefetch_factor(2));
  ASSERT_TRUE(loader.next().has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The batch taken, plus at most prefetch_factor x workers ready ahead, plus the batch each
  // worker is on.
  EXPECT_LE(ds->calls.load(), 4u * (1 + 2 * 2 + 2));
  EXPECT_GE(ds->calls.load(), 4u * (1 + 2 * 2));
  EXPECT_GT(loader.stats().wait_seconds, 0.0);
  EXPECT_EQ(loader.stats().batches, 1u);
}

TEST(Loader, PersistentWorkersServeEveryEpochAndDropAnAbandonedOne) {
  auto ds = numbers(30);
  data::DataLoader loader(ds,
                          data::LoaderOptions(4).workers(3).persistent_workers(true).shuffle(true));
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    loader.set_epoch(epoch);
    ASSERT_TRUE(loader.next().has_value());  // abandon the pass after one batch
    loader.set_epoch(epoch);
    auto batches = drain(loader);
    ASSERT_EQ(batches.size(), 8u);
    auto order = data::RandomSampler(30, 0).epoch_indices(epoch);
    EXPECT_EQ(batches[0].target[0].item<int64_t>(), static_cast<int64_t>(order[0]));
    EXPECT_EQ(batches[7].target[1].item<int64_t>(), static_cast<int64_t>(order[29]));
  }
}

TEST(Loader, CollateNamesMismatchedSamples) {
  std::vector<data::Sample> samples{{torch::zeros({3, 4, 4}), torch::tensor(0)},
                                    {torch::zeros({3, 5, 4}), torch::tensor(1)}};
  std::string e = error_of([&] { data::collate(samples); });
  EXPECT_NE(e.find("cannot stack sample 1 of the batch (data Float [3, 5, 4]) onto sample 0 "
                   "(Float [3, 4, 4])"),
            std::string::npos)
      << e;
  auto b = data::collate({samples[0], samples[0]});
  EXPECT_EQ(b.data.sizes(), torch::IntArrayRef({2, 3, 4, 4}));
  EXPECT_EQ(b.target.sizes(), torch::IntArrayRef({2}));
}

}  // namespace
}  // namespace paratrain
