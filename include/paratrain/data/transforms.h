#pragma once

// Image transforms with torchvision's semantics (torchvision.transforms on tensors, antialias on):
// images are tensors [C, H, W], uint8 until ToTensor or ConvertImageDtype makes them float in
// [0, 1]. Resize is bilinear with antialiasing, the same triangle filter torchvision (and PIL)
// use, computed in float and rounded back for uint8 images as torchvision does.
//
//   namespace T = paratrain::data::transforms;
//   auto train = T::compose(T::RandomResizedCrop(224), T::RandomHorizontalFlip(),
//                           T::ToTensor(), T::Normalize({0.485, 0.456, 0.406},
//                                                       {0.229, 0.224, 0.225}));
//   auto val = T::compose(T::Resize(256), T::CenterCrop(224), T::ToTensor(), T::Normalize(...));
//
// Random transforms draw from the Generator they are given. The DataLoader seeds one per sample
// from (seed, epoch, position in the epoch, index), so batches do not depend on the number of
// workers;
// datasets reach it through data::sample_generator().
//
// The transforms here run single-threaded per image on purpose: the loader runs one image per
// worker thread, and ATen's element-wise kernels would start an OpenMP team inside every worker.

#include <torch/types.h>

#include <array>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace paratrain {
namespace data {

using Generator = std::mt19937_64;

/// The calling thread's generator for the sample being loaded (see above). Outside a loader it
/// is a generator seeded 0 on first use.
Generator& sample_generator();

/// Seeds the calling thread's sample generator for dataset index `index` at `position` of
/// `epoch` under `seed`.
void seed_sample_generator(uint64_t seed, uint64_t epoch, uint64_t position, uint64_t index);

namespace transforms {

/// An image to image function. Thread-safe: one transform object serves all workers.
class Transform {
 public:
  virtual ~Transform() = default;
  virtual torch::Tensor apply(const torch::Tensor& image, Generator& gen) const = 0;
  /// As torchvision's repr, e.g. "Resize(size=256, antialias=True)".
  virtual std::string name() const = 0;

  torch::Tensor operator()(const torch::Tensor& image, Generator& gen) const {
    return apply(image, gen);
  }
  torch::Tensor operator()(const torch::Tensor& image) const {
    return apply(image, sample_generator());
  }
};
using TransformPtr = std::shared_ptr<const Transform>;

/// Size argument: one int (for Resize, the shorter side; for crops, a square) or (h, w).
struct Size {
  Size(int64_t side) : height(side), width(side), single(true) {}  // NOLINT: as torchvision
  Size(int64_t h, int64_t w) : height(h), width(w) {}
  int64_t height;
  int64_t width;
  bool single = false;
};

/// torchvision.transforms.Resize(size, antialias=True) with bilinear interpolation. A single
/// size sets the shorter side (the longer one keeps the aspect ratio, truncated as torchvision
/// does); (h, w) sets both.
class Resize final : public Transform {
 public:
  explicit Resize(Size size);
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;
  /// The output size for an input of height x width.
  std::array<int64_t, 2> output_size(int64_t height, int64_t width) const;

 private:
  Size size_;
};

/// torchvision.transforms.CenterCrop. An image smaller than the crop is an error (torchvision
/// pads it with zeros, which silently trains on black borders): resize first.
class CenterCrop final : public Transform {
 public:
  explicit CenterCrop(Size size);
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;

 private:
  Size size_;
};

/// torchvision.transforms.RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3),
/// antialias=True): up to 10 tries for a box of random area and log-uniform aspect ratio that
/// fits, else the central crop at the nearest allowed ratio; the box is resized to `size`.
class RandomResizedCrop final : public Transform {
 public:
  explicit RandomResizedCrop(Size size,
                             std::array<double, 2> scale = {0.08, 1.0},
                             std::array<double, 2> ratio = {3.0 / 4.0, 4.0 / 3.0});
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;
  /// The box (top, left, height, width) for an image of height x width.
  std::array<int64_t, 4> params(int64_t height, int64_t width, Generator& gen) const;
  Size size() const { return size_; }

 private:
  Size size_;
  std::array<double, 2> scale_;
  std::array<double, 2> ratio_;
};

/// torchvision.transforms.RandomHorizontalFlip(p=0.5).
class RandomHorizontalFlip final : public Transform {
 public:
  explicit RandomHorizontalFlip(double p = 0.5);
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;

 private:
  double p_;
};

/// torchvision.transforms.ConvertImageDtype(torch.float): uint8 to float in [0, 1] (x / 255);
/// a float image passes unchanged. Only float32 output is supported.
class ConvertImageDtype : public Transform {
 public:
  explicit ConvertImageDtype(torch::ScalarType dtype = torch::kFloat);
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;
};

/// torchvision.transforms.ToTensor for images that are already tensors [C, H, W]: uint8 to float
/// in [0, 1], as ConvertImageDtype(torch.float).
class ToTensor final : public ConvertImageDtype {
 public:
  ToTensor() = default;
  std::string name() const override { return "ToTensor()"; }
};

/// torchvision.transforms.Normalize(mean, std): (x - mean[c]) / std[c] on a float image. One
/// value, or one per channel.
class Normalize final : public Transform {
 public:
  Normalize(std::vector<double> mean, std::vector<double> std);
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;
  const std::vector<double>& mean() const { return mean_; }
  const std::vector<double>& std() const { return std_; }

 private:
  std::vector<double> mean_;
  std::vector<double> std_;
};

/// torchvision.transforms.Compose: each transform in turn. ToTensor (or ConvertImageDtype)
/// followed by Normalize runs as one pass over the image, with the same arithmetic.
class Compose final : public Transform {
 public:
  explicit Compose(std::vector<TransformPtr> transforms);
  torch::Tensor apply(const torch::Tensor& image, Generator& gen) const override;
  std::string name() const override;
  const std::vector<TransformPtr>& transforms() const { return transforms_; }

 private:
  std::vector<TransformPtr> transforms_;
};

/// Compose of copies of the given transforms: compose(Resize(256), CenterCrop(224), ...).
template <typename... Ts>
std::shared_ptr<const Compose> compose(Ts... ts) {
  return std::make_shared<const Compose>(
      std::vector<TransformPtr>{std::make_shared<const Ts>(std::move(ts))...});
}

/// Bilinear resize with antialiasing of a [C, H, W] uint8 or float image (any strides) to
/// height x width: torch.nn.functional.interpolate(mode="bilinear", antialias=True,
/// align_corners=False), rounded and clamped for uint8. Single-threaded.
torch::Tensor resize_bilinear(const torch::Tensor& image, int64_t height, int64_t width);

/// Decodes an encoded image and applies `transform`, letting a JPEG decode at a reduced size when
/// the transform's first step allows it without changing what it samples from (Resize keeping
/// the result at least its output size; RandomResizedCrop keeping its box at least `size`).
/// With draft false (or no transform) the image decodes at full size, as PIL without draft().
torch::Tensor decode_and_transform(const std::string& bytes,
                                   const std::string& name,
                                   const Transform* transform,
                                   Generator& gen,
                                   bool draft = true);

}  // namespace transforms
}  // namespace data
}  // namespace paratrain
