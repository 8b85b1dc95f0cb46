#include "paratrain/data/make_image_folder.h"

#include "paratrain/data/image.h"
#include "paratrain/data/transforms.h"

#include <torch/torch.h>

#include <filesystem>

namespace paratrain {
namespace data {

namespace fs = std::filesystem;

const std::vector<std::string>& fashion_mnist_class_folders() {
  static const std::vector<std::string> names{
      "0_t-shirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat",
      "5_sandal",      "6_shirt",   "7_sneaker",  "8_bag",   "9_ankle_boot"};
  return names;
}

namespace {

// Sample i's image: [C, H, W] uint8 at one of three sizes and two aspect ratios, tinted per
// sample so that the three channels differ, in the format and mode its number picks.
std::string encode_sample(const torch::Tensor& image,
                          size_t i,
                          const MakeImageFolderOptions& o,
                          std::string& ext) {
  torch::Tensor x = image.dim() == 2 ? image.unsqueeze(0) : image;
  const int64_t side = o.size() * static_cast<int64_t>(4 + i % 3) / 4;
  const int64_t width = i % 5 == 0 ? side * 5 / 4 : side;
  x = transforms::resize_bilinear(x, side, width);
  if (x.size(0) == 1) {
    // A per-sample tint: RGB images whose channels differ, as photos' do.
    const auto scale = torch::tensor({1.0, 0.6 + 0.4 * static_cast<double>(i % 7) / 6.0,
                                      1.0 - 0.3 * static_cast<double>(i % 4) / 3.0})
                           .view({3, 1, 1});
    x = (x.to(torch::kDouble) * scale).round().clamp(0, 255).to(torch::kUInt8);
  }
  const size_t kind = o.mixed() ? i % 8 : 0;
  switch (kind) {
    case 5:
      ext = ".jpg";  // grayscale JPEG
      return encode_jpeg(x.to(torch::kFloat).mean(0, true).round().to(torch::kUInt8),
                         o.jpeg_quality());
    case 6:
      ext = ".png";
      return encode_png(x);
    case 7: {
      ext = ".png";  // RGBA: alpha is dropped on reading, as PIL's convert("RGB")
      torch::Tensor alpha = torch::full({1, x.size(1), x.size(2)}, 200, torch::kUInt8);
      return encode_png(torch::cat({x, alpha}, 0));
    }
    case 4:
      ext = ".webp";
      return encode_webp(x);
    default:
      ext = i % 16 == 1 ? ".JPEG" : ".jpg";  // torchvision matches extensions in any case
      return encode_jpeg(x, o.jpeg_quality());
  }
}

}  // namespace

size_t write_image_folder(const torch::Tensor& images,
                          const torch::Tensor& labels,
                          const std::vector<std::string>& class_folders,
                          const std::string& root,
                          MakeImageFolderOptions options) {
  TORCH_CHECK(images.scalar_type() == torch::kUInt8 && (images.dim() == 3 || images.dim() == 4),
              "write_image_folder: expected uint8 images [N, H, W] or [N, 3, H, W], got ",
              images.scalar_type(), " ", images.sizes());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == images.size(0),
              "write_image_folder: ", images.size(0), " images but labels ", labels.sizes());
  TORCH_CHECK(options.size() >= 8, "write_image_folder: size must be >= 8, got ", options.size());
  std::error_code ec;
  for (const auto& c : class_folders) {
    fs::create_directories(fs::path(root) / c, ec);
    TORCH_CHECK(!ec, "cannot create ", (fs::path(root) / c).string(), ": ", ec.message());
  }
  torch::Tensor lab = labels.to(torch::kLong).contiguous();
  for (int64_t i = 0; i < images.size(0); ++i) {
    const int64_t label = lab[i].item<int64_t>();
    TORCH_CHECK(label >= 0 && label < static_cast<int64_t>(class_folders.size()),
                "write_image_folder: label ", label, " of sample ", i, " has no class folder (",
                class_folders.size(), " classes)");
    std::string ext;
    const std::string bytes = encode_sample(images[i], static_cast<size_t>(i), options, ext);
    write_file(
        (fs::path(root) / class_folders[static_cast<size_t>(label)] / (std::to_string(i) + ext))
            .string(),
        bytes);
  }
  return static_cast<size_t>(images.size(0));
}

}  // namespace data
}  // namespace paratrain
