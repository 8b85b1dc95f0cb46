#pragma once

// Image files to tensors and back: JPEG through libjpeg-turbo's TurboJPEG API, PNG through libpng,
// WebP through libwebp. Decoded images are uint8 tensors [3, H, W] in RGB, torchvision's tensor
// layout, whatever the file holds: grayscale, RGB, RGBA (alpha dropped) and CMYK all come out as
// PIL's Image.convert("RGB") gives them. The format is recognised from the file's first bytes,
// as PIL does, not from its name.
//
//   torch::Tensor img = data::read_image("cat.jpg");                 // [3, H, W] uint8
//   torch::Tensor small = data::read_image("cat.jpg", {224, 224});   // JPEG: DCT-scaled decode
//
// Every error is a c10::Error whose message names the file and says what is wrong with it.
// All functions are thread-safe.

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace paratrain {
namespace data {

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp };

/// "JPEG", "PNG", "WebP" or "unknown".
const char* to_string(ImageFormat format);

/// The format of an encoded image, from its first bytes (kUnknown when none matches).
ImageFormat sniff_image_format(const void* data, size_t size);

struct ImageSize {
  int64_t height = 0;
  int64_t width = 0;
};

/// The size of an encoded image, read from its header. `name` stands for it in error messages.
ImageSize read_image_size(const std::string& bytes, const std::string& name);

/// Decodes an encoded image to RGB uint8 [3, H, W]. A JPEG whose decoded size may shrink (the
/// `at_least` size is > 0) is decoded straight to the smallest of libjpeg-turbo's scaled sizes
/// (1/8 steps, in the DCT domain, as PIL's Image.draft) whose height and width stay at least
/// at_least's; other formats decode at full size. Throws for a corrupt or truncated file.
torch::Tensor decode_image(const std::string& bytes,
                           const std::string& name,
                           ImageSize at_least = ImageSize());

/// The whole file as bytes. Throws naming the file and the system's reason.
std::string read_file(const std::string& path);

/// read_file + decode_image.
torch::Tensor read_image(const std::string& path, ImageSize at_least = ImageSize());

/// Encoders for making datasets and tests. `image` is uint8 [C, H, W] (or [H, W] for gray):
///   JPEG: C = 1 (grayscale JPEG), 3 (RGB, 4:2:0) or 4 (CMYK; written as Adobe-style YCCK);
///   PNG:  C = 1, 2 (gray + alpha), 3 or 4 (RGBA);
///   WebP: C = 3 or 4, lossless.
std::string encode_jpeg(const torch::Tensor& image, int quality = 90);
std::string encode_png(const torch::Tensor& image);
std::string encode_webp(const torch::Tensor& image);

/// Writes the bytes to path (created or truncated). Throws naming the path.
void write_file(const std::string& path, const std::string& bytes);

}  // namespace data
}  // namespace paratrain
