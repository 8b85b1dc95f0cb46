#include "paratrain/data/fashion_mnist.h"

#include <torch/torch.h>
#include <zlib.h>

#include <sys/stat.h>
#include <cstdint>

namespace paratrain {
namespace data {

namespace {

constexpr uint32_t kImagesMagic = 2051;  // 0x00000803: unsigned bytes, 3 dimensions
constexpr uint32_t kLabelsMagic = 2049;  // 0x00000801: unsigned bytes, 1 dimension

// zlib reads gzip and plain files alike.
class GzFile {
 public:
  explicit GzFile(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    struct stat st;
    TORCH_CHECK(::stat(path.c_str(), &st) == 0, "Fashion-MNIST: ", path,
                " does not exist; install Debian's dataset-fashion-mnist or pass --data-dir");
    TORCH_CHECK(file_ != nullptr, "Fashion-MNIST: cannot open ", path);
  }
  ~GzFile() {
    if (file_ != nullptr) {
      gzclose(file_);
    }
  }
  // Reads exactly n bytes or throws, naming what was being read.
  void read(void* out, size_t n, const char* what) {
    size_t done = 0;
    while (done < n) {
      int got = gzread(file_, static_cast<char*>(out) + done,
                       static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30)));
      if (got < 0) {
        int err = 0;
        const char* message = gzerror(file_, &err);
        TORCH_CHECK(false, "Fashion-MNIST: ", path_, " is corrupt (", message, ") while reading ",
                    what);
      }
      TORCH_CHECK(got > 0, "Fashion-MNIST: ", path_, " is truncated: it ends after ", done,
                  " of the ", n, " bytes of ", what);
      done += static_cast<size_t>(got);
    }
  }
  uint32_t read_be32(const char* what) {
    unsigned char b[4];
    read(b, 4, what);
    return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | b[3];
  }

 private:
  std::string path_;
  gzFile file_;
};

}  // namespace

torch::Tensor read_idx_file(const std::string& path, bool images) {
  GzFile f(path);
  const uint32_t magic = f.read_be32("the header");
  const uint32_t expected = images ? kImagesMagic : kLabelsMagic;
  TORCH_CHECK(magic == expected, "Fashion-MNIST: ", path, " has magic number ", magic,
              ", expected ", expected, " (", images ? "an idx3 image file" : "an idx1 label file",
              "): wrong or damaged file");
  const uint32_t count = f.read_be32("the header");
  std::vector<int64_t> shape{count};
  if (images) {
    const uint32_t rows = f.read_be32("the header");
    const uint32_t cols = f.read_be32("the header");
    TORCH_CHECK(rows == 28 && cols == 28, "Fashion-MNIST: ", path, " holds ", rows, "x", cols,
                " images, expected 28x28");
    shape.push_back(rows);
    shape.push_back(cols);
  }
  torch::Tensor data = torch::empty(shape, torch::kUInt8);
  f.read(data.data_ptr(), static_cast<size_t>(data.numel()),
         images ? "the image pixels" : "the labels");
  return data;
}

FashionMNIST::FashionMNIST(const std::string& root, Split split) {
  const std::string prefix = root + "/" + (split == Split::kTrain ? "train" : "t10k");
  torch::Tensor raw_images = read_idx_file(prefix + "-images-idx3-ubyte.gz", true);
  torch::Tensor raw_labels = read_idx_file(prefix + "-labels-idx1-ubyte.gz", false);
  TORCH_CHECK(raw_images.size(0) == raw_labels.size(0), "Fashion-MNIST: ", prefix, "-images holds ",
              raw_images.size(0), " images but ", prefix, "-labels holds ", raw_labels.size(0),
              " labels");
  TORCH_CHECK(raw_labels.numel() == 0 || raw_labels.max().item<int>() <= 9,
              "Fashion-MNIST: ", prefix, "-labels holds a label above 9");
  images_ = raw_images.unsqueeze(1)
                .to(torch::kFloat)
                .div_(255.0)
                .sub_(kFashionMnistMean)
                .div_(kFashionMnistStd);
  targets_ = raw_labels.to(torch::kLong);
}

torch::data::Example<> FashionMNIST::get(size_t index) {
  return {images_[static_cast<int64_t>(index)], targets_[static_cast<int64_t>(index)]};
}

c10::optional<size_t> FashionMNIST::size() const {
  return static_cast<size_t>(images_.size(0));
}

torch::Tensor adapt_images(const torch::Tensor& images, int64_t size, int64_t channels) {
  TORCH_CHECK(size >= 1 && channels >= 1, "image size and channels must be >= 1, got ", size,
              " and ", channels);
  TORCH_CHECK(images.dim() == 4, "expected a batch of N x C x H x W images, got shape ",
              images.sizes());
  torch::Tensor out = images;
  if (out.size(2) != size || out.size(3) != size) {
    namespace F = torch::nn::functional;
    out = F::interpolate(out, F::InterpolateFuncOptions()
                                  .size(std::vector<int64_t>{size, size})
                                  .mode(torch::kBilinear)
                                  .align_corners(false));
  }
  if (out.size(1) != channels) {
    TORCH_CHECK(out.size(1) == 1, "cannot turn ", out.size(1), "-channel images into ", channels,
                " channels (only 1-channel images are repeated)");
    out = out.expand({out.size(0), channels, out.size(2), out.size(3)}).contiguous();
  }
  return out;
}

}  // namespace data
}  // namespace paratrain
