#pragma once

// Fashion-MNIST from the gzip'd idx files that Debian's dataset-fashion-mnist package installs in
// /usr/share/datasets/fashion-mnist (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
// t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz).
//
// Images come as float tensors [N, 1, 28, 28], scaled to [0, 1] and then normalised with the
// dataset's mean 0.2860 and std 0.3530; targets as int64 [N] in 0..9.

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <string>

namespace paratrain {
namespace data {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;

class FashionMNIST : public torch::data::datasets::Dataset<FashionMNIST> {
 public:
  enum class Split { kTrain, kTest };

  /// Reads and checks both files of the split (magic numbers, dimensions, lengths). Throws
  /// c10::Error naming the file and what is wrong with it.
  explicit FashionMNIST(const std::string& root = kFashionMnistDir, Split split = Split::kTrain);

  torch::data::Example<> get(size_t index) override;
  c10::optional<size_t> size() const override;

  const torch::Tensor& images() const { return images_; }
  const torch::Tensor& targets() const { return targets_; }

 private:
  torch::Tensor images_;
  torch::Tensor targets_;
};

/// Reads one gzip'd (or plain) idx file and checks its magic number: 2051 for images, 2049 for
/// labels. Returns uint8 data shaped [N, 28, 28] or [N]. A file that does not exist is an
/// OptionError on "root", the folder FashionMNIST reads (a command line's --data-dir).
torch::Tensor read_idx_file(const std::string& path, bool images);

/// The same for the `size` bytes of an idx file already in memory, gzip'd or plain. `name` stands
/// for the file in error messages.
torch::Tensor read_idx_bytes(const void* data,
                             size_t size,
                             bool images,
                             const std::string& name = "idx data");

/// A batch of N x 1 x 28 x 28 images made fit for models that expect other inputs: bilinearly
/// resized to size x size and the channel repeated `channels` times (3 for the ResNets), or a
/// 3-channel batch averaged to 1 channel for the 1-channel models. Returns the batch itself when
/// it already has that shape. Throws c10::Error for size or channels < 1
/// or a channel count that is not 1 or the batch's.
torch::Tensor adapt_images(const torch::Tensor& images, int64_t size, int64_t channels);

}  // namespace data
}  // namespace paratrain
