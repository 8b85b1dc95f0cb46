// Decoding (TurboJPEG, libpng, libwebp) and the torchvision transforms: round trips, every mode
// coming out as RGB, DCT-scaled decoding, corrupt files named in the errors, and outputs compared
// with python3-torchvision's (PIL decoding, tensor transforms with antialias) on images made from
// Fashion-MNIST pictures.

#include "paratrain/data/image.h"
#include "paratrain/data/fashion_mnist.h"
#include "paratrain/data/transforms.h"
#include "paratrain/io/torch_load.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace paratrain {
namespace {

using namespace testing;
namespace fs = std::filesystem;
namespace T = data::transforms;

// A photo-like RGB image [3, h, w]: three different Fashion-MNIST pictures, upscaled smoothly, as
// its three channels, so edges and gradients differ between channels.
torch::Tensor real_image(int64_t h, int64_t w, int64_t first = 0) {
  static const torch::Tensor images =
      data::read_idx_file(std::string(data::kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz", true);
  std::vector<torch::Tensor> channels;
  for (int64_t c = 0; c < 3; ++c) {
    channels.push_back(T::resize_bilinear(images[first + c * 7].unsqueeze(0), h, w).squeeze(0));
  }
  return torch::stack(channels);
}

std::string temp_dir(const std::string& name) {
  const std::string dir = "/tmp/" + unique_token(name);
  fs::create_directories(dir);
  return dir;
}

double mean_abs_01(const torch::Tensor& a, const torch::Tensor& b) {
  auto fa = a.scalar_type() == torch::kUInt8 ? a.to(torch::kFloat) / 255 : a.to(torch::kFloat);
  auto fb = b.scalar_type() == torch::kUInt8 ? b.to(torch::kFloat) / 255 : b.to(torch::kFloat);
  return (fa - fb).abs().mean().item<double>();
}

TEST(Image, PngAndWebpRoundTripExactly) {
  torch::Tensor img = real_image(37, 53);
  EXPECT_TRUE(torch::equal(data::decode_image(data::encode_png(img), "a.png"), img));
  EXPECT_TRUE(torch::equal(data::decode_image(data::encode_webp(img), "a.webp"), img));
  // RGBA: the alpha is dropped (PIL's convert("RGB")), the colour kept.
  torch::Tensor rgba = torch::cat({img, torch::full({1, 37, 53}, 17, torch::kUInt8)});
  EXPECT_TRUE(torch::equal(data::decode_image(data::encode_png(rgba), "rgba.png"), img));
  EXPECT_TRUE(torch::equal(data::decode_image(data::encode_webp(rgba), "rgba.webp"), img));
  // Gray PNG: three equal channels.
  torch::Tensor gray = img[0];
  torch::Tensor three = data::decode_image(data::encode_png(gray), "g.png");
  EXPECT_TRUE(torch::equal(three, gray.unsqueeze(0).expand({3, 37, 53})));
  auto size = data::read_image_size(data::encode_png(img), "a.png");
  EXPECT_EQ(size.height, 37);
  EXPECT_EQ(size.width, 53);
}

TEST(Image, JpegModesComeOutRgb) {
  torch::Tensor img = real_image(64, 96);
  torch::Tensor rgb = data::decode_image(data::encode_jpeg(img, 95), "a.jpg");
  ASSERT_EQ(rgb.sizes(), img.sizes());
  EXPECT_LT(mean_abs_01(rgb, img), 8.0 / 255);  // lossy (4:2:0 chroma), at quality 95
  torch::Tensor gray = data::decode_image(data::encode_jpeg(img[1], 95), "g.jpg");
  ASSERT_EQ(gray.sizes(), img.sizes());
  EXPECT_TRUE(torch::equal(gray[0], gray[1]) && torch::equal(gray[1], gray[2]));
  EXPECT_LT(mean_abs_01(gray[0], img[1]), 3.0 / 255);
  // CMYK (written as Adobe YCCK) decodes to 3 channels; the values are checked against PIL in
  // Image.DecodersMatchPil.
  torch::Tensor cmyk = torch::cat({img, img[0].unsqueeze(0)});
  EXPECT_EQ(data::decode_image(data::encode_jpeg(cmyk, 95), "c.jpg").sizes(), img.sizes());
}

TEST(Image, JpegDecodesStraightToAScaledSize) {
  torch::Tensor img = real_image(300, 400);
  const std::string jpeg = data::encode_jpeg(img, 90);
  torch::Tensor small = data::decode_image(jpeg, "big.jpg", {100, 100});
  // The smallest 1/8 step keeping both sides >= 100: 3/8 (113 x 150); 2/8 would give 75.
  EXPECT_EQ(small.sizes(), torch::IntArrayRef({3, 113, 150}));
  EXPECT_EQ(data::decode_image(jpeg, "big.jpg", {300, 400}).sizes(), img.sizes());
  EXPECT_EQ(data::decode_image(jpeg, "big.jpg", {10, 10}).sizes(),
            torch::IntArrayRef({3, 38, 50}));  // 1/8
  // The scaled decode looks like the full one resized.
  torch::Tensor resized = T::resize_bilinear(data::decode_image(jpeg, "big.jpg"), 113, 150);
  EXPECT_LT(mean_abs_01(small, resized), 4.0 / 255);
}

TEST(Image, CorruptFilesAreNamed) {
  const std::string dir = temp_dir("img-bad");
  const std::string jpeg = data::encode_jpeg(real_image(64, 64), 90);
  data::write_file(dir + "/cut.jpg", jpeg.substr(0, jpeg.size() / 2));
  std::string e = error_of([&] { data::read_image(dir + "/cut.jpg"); });
  EXPECT_NE(e.find(dir + "/cut.jpg"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated JPEG"), std::string::npos) << e;

  data::write_file(dir + "/text.jpg", "this is not an image\n");
  e = error_of([&] { data::read_image(dir + "/text.jpg"); });
  EXPECT_NE(e.find("cannot decode " + dir + "/text.jpg: not a JPEG, PNG or WebP file"),
            std::string::npos)
      << e;
  data::write_file(dir + "/empty.png", "");
  e = error_of([&] { data::read_image(dir + "/empty.png"); });
  EXPECT_NE(e.find("the file is empty"), std::string::npos) << e;

  const std::string png = data::encode_png(real_image(64, 64));
  data::write_file(dir + "/cut.png", png.substr(0, png.size() - 40));
  e = error_of([&] { data::read_image(dir + "/cut.png"); });
  EXPECT_NE(e.find("cannot decode " + dir + "/cut.png: PNG"), std::string::npos) << e;

  const std::string webp = data::encode_webp(real_image(64, 64));
  data::write_file(dir + "/cut.webp", webp.substr(0, webp.size() / 2));
  e = error_of([&] { data::read_image(dir + "/cut.webp"); });
  EXPECT_NE(e.find("cannot decode " + dir + "/cut.webp: corrupt or truncated WebP"),
            std::string::npos)
      << e;
  // A header claiming 60000 x 60000 pixels (SOF0's height and width patched): refused before
  // any allocation, as PIL's decompression-bomb check.
  std::string bomb = jpeg;
  const size_t sof = bomb.find("\xFF\xC0");
  ASSERT_NE(sof, std::string::npos);
  bomb.replace(sof + 5, 4, "\xEA\x60\xEA\x60");
  data::write_file(dir + "/bomb.jpg", bomb);
  e = error_of([&] { data::read_image(dir + "/bomb.jpg"); });
  EXPECT_NE(e.find("image size 60000x60000 (HxW) is empty or above the limit"), std::string::npos)
      << e;
  e = error_of([&] { data::read_image(dir + "/missing.jpg"); });
  EXPECT_NE(e.find("cannot read " + dir + "/missing.jpg: No such file"), std::string::npos) << e;
  e = error_of([&] { data::read_image(dir); });
  EXPECT_NE(e.find("cannot read " + dir + ": it is a folder, not an image file"), std::string::npos)
      << e;
  remove_tree(dir);
}

TEST(Transforms, RandomResizedCropFollowsTorchvisionsRules) {
  T::RandomResizedCrop crop(224);
  data::Generator gen(1);
  for (int i = 0; i < 2000; ++i) {
    const int64_t h = 50 + i % 300, w = 40 + (i * 7) % 500;
    const auto box = crop.params(h, w, gen);
    ASSERT_GE(box[0], 0);
    ASSERT_GE(box[1], 0);
    ASSERT_LE(box[0] + box[2], h);
    ASSERT_LE(box[1] + box[3], w);
    const double area = static_cast<double>(box[2] * box[3]) / static_cast<double>(h * w);
    const double ratio = static_cast<double>(box[3]) / static_cast<double>(box[2]);
    const bool fallback =
        box[0] == (h - box[2]) / 2 && box[1] == (w - box[3]) / 2 && (box[2] == h || box[3] == w);
    if (!fallback) {  // rounding of the sides moves area and ratio a little
      EXPECT_GT(area, 0.07);
      EXPECT_GT(ratio, 0.70);
      EXPECT_LT(ratio, 1.40);
    }
  }
  // Nothing fits scale (2, 3): torchvision's fallback, the central crop at the nearest ratio.
  T::RandomResizedCrop never(10, {2.0, 3.0});
  EXPECT_EQ(never.params(100, 300, gen), (std::array<int64_t, 4>{0, 83, 100, 133}));
  EXPECT_EQ(never.params(300, 100, gen), (std::array<int64_t, 4>{83, 0, 133, 100}));
  EXPECT_EQ(never.params(100, 120, gen), (std::array<int64_t, 4>{0, 0, 100, 120}));
  // The same generator state gives the same crop; the output has the asked size.
  data::Generator a(7), b(7);
  torch::Tensor img = real_image(90, 120);
  EXPECT_TRUE(torch::equal(crop(img, a), crop(img, b)));
  EXPECT_EQ(crop(img, a).sizes(), torch::IntArrayRef({3, 224, 224}));
}

TEST(Transforms, BadInputIsRefused) {
  torch::Tensor img = real_image(40, 50);
  std::string e = error_of([&] { T::CenterCrop(64)(img); });
  EXPECT_NE(e.find("CenterCrop(64): the image is 40x50 (HxW), smaller than the crop"),
            std::string::npos)
      << e;
  e = error_of([&] { T::Normalize({0.5}, {0.5})(img); });
  EXPECT_NE(e.find("Normalize: the image must be float"), std::string::npos) << e;
  e = error_of([&] { T::Normalize({0.5, 0.5}, {0.5})(T::ToTensor()(img)); });
  EXPECT_NE(e.find("2 values of mean for an image of 3 channels"), std::string::npos) << e;
  EXPECT_NE(error_of([] { T::Normalize({0.5}, {0.0}); }).find("division by zero"),
            std::string::npos);
  EXPECT_NE(error_of([] { T::Resize(0); }).find("Resize: the size must be positive"),
            std::string::npos);
  EXPECT_NE(error_of([&] { T::Resize(10)(img[0]); }).find("expected an image [C, H, W]"),
            std::string::npos);
  // Flip and the dtype conversion are exact.
  data::Generator gen(0);
  EXPECT_TRUE(torch::equal(T::RandomHorizontalFlip(1.0)(img, gen), img.flip({2})));
  EXPECT_TRUE(torch::equal(T::RandomHorizontalFlip(0.0)(img, gen), img));
  EXPECT_TRUE(torch::allclose(T::ToTensor()(img), img.to(torch::kFloat) / 255));
}

TEST(Transforms, DecodersAndTransformsMatchTorchvision) {
  if (!python_has("torchvision")) {
    GTEST_SKIP() << test_python() << " has no torchvision to write the reference outputs";
  }
  const std::string dir = temp_dir("tv-transforms");
  torch::Tensor a = real_image(200, 300);
  torch::Tensor b = real_image(131, 97, 3);
  data::write_file(dir + "/a.png", data::encode_png(a));
  data::write_file(dir + "/b.jpg", data::encode_jpeg(b, 85));
  data::write_file(dir + "/c_gray.jpg", data::encode_jpeg(a[2], 90));
  data::write_file(dir + "/d_rgba.png",
                   data::encode_png(torch::cat({b, torch::full({1, 131, 97}, 9, torch::kUInt8)})));
  data::write_file(dir + "/e.webp", data::encode_webp(a));
  data::write_file(dir + "/f_cmyk.jpg", data::encode_jpeg(torch::cat({b, b[1].unsqueeze(0)}), 90));
  const std::string out = dir + "/ref.pt";
  auto r = run_process(
      {test_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/make_transforms_reference.py", dir,
       out, "a.png", "b.jpg"},
      {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ref = load_torch_state_dict(out);
  for (const char* name : {"a.png", "b.jpg", "c_gray.jpg", "d_rgba.png", "e.webp", "f_cmyk.jpg"}) {
    SCOPED_TRACE(name);
    torch::Tensor ours = data::read_image(dir + "/" + name);
    const torch::Tensor& pil = ref.at(std::string("decoded/") + name);
    ASSERT_EQ(ours.sizes(), pil.sizes());
    // The same libjpeg-turbo, libpng and libwebp as PIL's: the same pixels.
    EXPECT_EQ((ours.to(torch::kInt) - pil.to(torch::kInt)).abs().max().item<int>(), 0);
  }
  const std::vector<double> mean{0.485, 0.456, 0.406}, std{0.229, 0.224, 0.225};
  data::Generator gen(0);
  for (const char* name : {"a.png", "b.jpg"}) {
    const std::string n = name;
    torch::Tensor img = ref.at("decoded/" + n);
    std::map<std::string, torch::Tensor> ours{
        {"resize_up", T::Resize(256)(img)},
        {"resize_down", T::Resize(64)(img)},
        {"resize_exact", T::Resize({50, 80})(img)},
        {"resize_float", T::Resize(57)(T::ConvertImageDtype()(img))},
        {"center_crop", T::CenterCrop({61, 90})(img)},
        {"resized_crop", T::resize_bilinear(img.slice(1, 10, 130).slice(2, 5, 95), 224, 224)},
        {"hflip", T::RandomHorizontalFlip(1.0)(img, gen)},
        {"val_pipeline", (*T::compose(T::Resize(73), T::CenterCrop(64), T::ConvertImageDtype(),
                                      T::Normalize(mean, std)))(img)},
    };
    for (const auto& [op, value] : ours) {
      SCOPED_TRACE(n + "/" + op);
      const torch::Tensor& theirs = ref.at(n + "/" + op);
      ASSERT_EQ(value.sizes(), theirs.sizes());
      ASSERT_EQ(value.scalar_type(), theirs.scalar_type());
      const double scale = op == "val_pipeline" ? 0.229 : 1.0;  // back to [0, 1] units
      const double diff = mean_abs_01(value, theirs) * scale;
      EXPECT_LE(diff, 1.0 / 255) << "mean absolute difference " << diff * 255 << "/255";
      // Same filter, same order of sums: never more than one step of uint8 apart.
      EXPECT_LE((value.to(torch::kDouble) - theirs.to(torch::kDouble)).abs().max().item<double>() *
                    (value.scalar_type() == torch::kUInt8 ? 1.0 : 255.0 * scale),
                1.0 + 1e-3);
    }
  }
  remove_tree(dir);
}

}  // namespace
}  // namespace paratrain
