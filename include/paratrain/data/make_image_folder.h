#pragma once

// Writes labelled images as an ImageFolder (root/<class>/<file>), encoded with the same libraries
// paratrain decodes with, in a mix of formats, modes and sizes, so that a folder made from a
// known dataset exercises everything a real photo collection does. `paratrain data
// make-imagefolder` and the tests use it.

#include <torch/arg.h>
#include <torch/types.h>

#include <string>
#include <vector>

namespace paratrain {
namespace data {

struct MakeImageFolderOptions {
  /// The shorter side of the written images; some are written 25% and 50% larger, and some 25%
  /// wider than tall.
  TORCH_ARG(int64_t, size) = 64;
  /// Only JPEGs (RGB) when false; else also grayscale JPEGs, RGB and RGBA PNGs and WebPs.
  TORCH_ARG(bool, mixed) = true;
  /// JPEG quality, 1-100 (libjpeg's).
  TORCH_ARG(int, jpeg_quality) = 90;
};

/// The Fashion-MNIST class names as folder names, prefixed by their index so that their sorted
/// order is the label order: "0_t-shirt_top", "1_trouser", ...
const std::vector<std::string>& fashion_mnist_class_folders();

/// Writes images [N, H, W] (gray) or [N, 3, H, W] uint8 with labels [N] under `root`, sample i
/// to root/<class_folders[label]>/<i>.<ext>. Creates the folders; returns the number written.
size_t write_image_folder(const torch::Tensor& images,
                          const torch::Tensor& labels,
                          const std::vector<std::string>& class_folders,
                          const std::string& root,
                          MakeImageFolderOptions options = {});

}  // namespace data
}  // namespace paratrain
