#pragma once

// Map-style datasets, as torch.utils.data.Dataset: size() samples, each got by index as a pair of
// tensors (data, target) of any shapes. The DataLoader calls get() from several worker threads
// at once, so get() must be thread-safe (reading shared state is; the datasets here only read).
//
//   auto train = std::make_shared<data::ImageFolder>("photos/train", train_transform);
//   auto mnist = std::make_shared<data::TensorDataset>(fm.images(), fm.targets());
//   auto theirs = data::from_torch(MyTorchDataset(...));   // any torch::data dataset
//
// Random transforms draw from data::sample_generator() (transforms.h), which the loader seeds
// per sample.

#include "paratrain/data/transforms.h"

#include <torch/arg.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace data {

struct Sample {
  torch::Tensor data;
  torch::Tensor target;
};

/// A batch: samples stacked along a new first dimension.
struct Batch {
  torch::Tensor data;
  torch::Tensor target;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual size_t size() const = 0;
  /// Sample `index` (< size()). Thread-safe.
  virtual Sample get(size_t index) = 0;
  /// A whole batch at once, for datasets that can do better than one get() per index (as
  /// PyTorch's __getitems__); nullopt (the default) makes the loader call get() per index.
  virtual std::optional<Batch> get_batch(const std::vector<size_t>& /*indices*/) {
    return std::nullopt;
  }
  /// What sample `index` is, for error messages (an ImageFolder's file); empty when nothing
  /// more than the index can be said.
  virtual std::string describe(size_t /*index*/) const { return {}; }
};
using DatasetPtr = std::shared_ptr<Dataset>;

/// Samples stacked into a batch: data [N, ...] and target [N, ...]. Throws naming the first
/// sample whose shape or dtype differs from the first one's. With pin_memory the batch is
/// allocated in page-locked memory (CUDA builds with a GPU; ignored otherwise).
Batch collate(const std::vector<Sample>& samples, bool pin_memory = false);

/// collate() one sample at a time: each is copied into the batch as it is added, so a loader
/// need not hold a whole batch of samples. Batch buffers are recycled once freed.
class Collator {
 public:
  /// Room for `capacity` samples.
  Collator(size_t capacity, bool pin_memory);
  void add(const Sample& sample);
  size_t size() const { return count_; }
  /// The batch of the samples added (undefined tensors when none was).
  Batch finish();

 private:
  size_t capacity_;
  bool pin_;
  size_t count_ = 0;
  Batch batch_;
};

/// In-memory tensors, one sample per index of the first dimension (torch.utils.data.TensorDataset).
/// An optional transform applies to each sample's data.
class TensorDataset : public Dataset {
 public:
  TensorDataset(torch::Tensor data, torch::Tensor targets, transforms::TransformPtr transform = {});
  size_t size() const override { return static_cast<size_t>(data_.size(0)); }
  Sample get(size_t index) override;
  /// One index_select per batch when there is no transform.
  std::optional<Batch> get_batch(const std::vector<size_t>& indices) override;

 private:
  torch::Tensor data_;
  torch::Tensor targets_;
  transforms::TransformPtr transform_;
};

/// A torch::data::datasets::Dataset (Example<> samples) as a paratrain Dataset, unchanged.
template <typename TorchDataset>
class TorchDatasetAdapter : public Dataset {
 public:
  explicit TorchDatasetAdapter(TorchDataset dataset) : dataset_(std::move(dataset)) {}
  size_t size() const override {
    auto n = dataset_.size();
    TORCH_CHECK(n.has_value(), "TorchDatasetAdapter: the dataset has no size (a map-style ",
                "dataset must know its size)");
    return *n;
  }
  Sample get(size_t index) override {
    auto example = dataset_.get(index);
    return {std::move(example.data), std::move(example.target)};
  }
  TorchDataset& dataset() { return dataset_; }

 private:
  TorchDataset dataset_;
};

template <typename TorchDataset>
std::shared_ptr<TorchDatasetAdapter<TorchDataset>> from_torch(TorchDataset dataset) {
  return std::make_shared<TorchDatasetAdapter<TorchDataset>>(std::move(dataset));
}

/// Options shared by the image datasets.
struct ImageDatasetOptions {
  /// Let JPEGs decode at a reduced size when the transform's first step allows (see
  /// transforms::decode_and_transform); off decodes every image at full size.
  TORCH_ARG(bool, draft) = true;
};

/// Image files with integer labels. Samples: data = transform(image) (uint8 [3, H, W] without a
/// transform), target = int64 scalar.
class ImageDataset : public Dataset {
 public:
  size_t size() const override { return samples_.size(); }
  Sample get(size_t index) override;
  std::string describe(size_t index) const override;
  /// (path, label) of every sample, in order.
  const std::vector<std::pair<std::string, int64_t>>& samples() const { return samples_; }
  const transforms::TransformPtr& transform() const { return transform_; }

 protected:
  ImageDataset(transforms::TransformPtr transform, ImageDatasetOptions options)
      : transform_(std::move(transform)), options_(options) {}
  std::vector<std::pair<std::string, int64_t>> samples_;
  transforms::TransformPtr transform_;
  ImageDatasetOptions options_;
};

/// torchvision.datasets.ImageFolder: root/<class>/**/<file>, classes the sorted names of root's
/// subfolders, files found recursively (following links) and sorted, kept when their name ends
/// (in any case) in one of torchvision's image extensions. Throws, naming the path, for a missing
/// root, a root without class folders, and a class folder without images.
class ImageFolder : public ImageDataset {
 public:
  explicit ImageFolder(const std::string& root,
                       transforms::TransformPtr transform = {},
                       ImageDatasetOptions options = {});
  const std::vector<std::string>& classes() const { return classes_; }
  const std::map<std::string, int64_t>& class_to_idx() const { return class_to_idx_; }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
  std::vector<std::string> classes_;
  std::map<std::string, int64_t> class_to_idx_;
};

/// A list file of "path label" lines (label a non-negative integer, the last field; blank lines
/// and lines starting with # are skipped). Relative paths are relative to `root`, or to the list
/// file's folder when root is empty. Throws naming the file and line for a malformed line.
class ImageList : public ImageDataset {
 public:
  explicit ImageList(const std::string& list_file,
                     transforms::TransformPtr transform = {},
                     std::string root = {},
                     ImageDatasetOptions options = {});
};

/// torchvision's IMG_EXTENSIONS: .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp. paratrain
/// decodes JPEG, PNG and WebP; a file of the other kinds gives an error when it is read.
const std::vector<std::string>& image_extensions();

}  // namespace data
}  // namespace paratrain
