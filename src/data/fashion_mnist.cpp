#include "paratrain/data/fashion_mnist.h"

#include "paratrain/base/option_error.h"

#include <torch/torch.h>
#include <zlib.h>

#include <sys/stat.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <vector>

namespace paratrain {
namespace data {

namespace {

constexpr uint32_t kImagesMagic = 2051;  // 0x00000803: unsigned bytes, 3 dimensions
constexpr uint32_t kLabelsMagic = 2049;  // 0x00000801: unsigned bytes, 1 dimension

// Reads an idx file's bytes in order, inflating them when they are gzip'd. Like gzread: plain
// bytes are read as they are, gzip members that follow one another are read as one stream, and
// anything after the last member that is not gzip is ignored.
class IdxReader {
 public:
  IdxReader(const void* data, size_t size, const std::string& name)
      : pos_(static_cast<const unsigned char*>(data)), end_(pos_ + size), name_(name) {
    gzip_ = is_gzip(pos_, end_);
    if (gzip_) {
      TORCH_CHECK(inflateInit2(&z_, 16 + MAX_WBITS) == Z_OK, "Fashion-MNIST: cannot inflate ",
                  name_, ": zlib failed to start");
    }
  }
  ~IdxReader() {
    if (gzip_) {
      inflateEnd(&z_);
    }
  }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  // Reads up to n bytes, fewer only where the data ends; throws for damaged gzip data, naming
  // what was being read.
  size_t read_some(void* out, size_t n, const char* what) {
    auto* dst = static_cast<unsigned char*>(out);
    size_t done = 0;
    if (!gzip_) {
      done = std::min(n, static_cast<size_t>(end_ - pos_));
      if (done > 0) {
        std::memcpy(dst, pos_, done);
      }
      pos_ += done;
    }
    while (gzip_ && done < n && !ended_) {
      z_.next_in = const_cast<Bytef*>(pos_);
      z_.avail_in = static_cast<uInt>(std::min<size_t>(end_ - pos_, kMaxChunk));
      z_.next_out = dst + done;
      z_.avail_out = static_cast<uInt>(std::min<size_t>(n - done, kMaxChunk));
      const uInt room = z_.avail_out;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      done += room - z_.avail_out;
      pos_ = z_.next_in;
      if (rc == Z_STREAM_END) {
        // Another gzip member may follow (gzip files concatenated); anything else ends the data.
        if (is_gzip(pos_, end_)) {
          inflateReset(&z_);
        } else {
          ended_ = true;
        }
      } else if (rc == Z_BUF_ERROR && pos_ == end_) {
        ended_ = true;  // the data stops inside a gzip member: truncated
      } else if (rc != Z_OK) {
        TORCH_CHECK(false, "Fashion-MNIST: ", name_, " is corrupt (",
                    z_.msg != nullptr ? z_.msg : "zlib error " + std::to_string(rc),
                    ") while reading ", what);
      }
    }
    return done;
  }
  // Reads exactly n bytes or throws.
  void read(void* out, size_t n, const char* what) {
    const size_t done = read_some(out, n, what);
    TORCH_CHECK(done == n, "Fashion-MNIST: ", name_, " is truncated: it ends after ", done,
                " of the ", n, " bytes of ", what);
  }
  uint32_t read_be32(const char* what) {
    unsigned char b[4];
    read(b, 4, what);
    return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | b[3];
  }

 private:
  static constexpr size_t kMaxChunk = size_t{1} << 30;  // zlib counts in 32-bit uInt
  static bool is_gzip(const unsigned char* p, const unsigned char* end) {
    return end - p >= 2 && p[0] == 0x1f && p[1] == 0x8b;
  }

  const unsigned char* pos_;
  const unsigned char* end_;
  std::string name_;
  bool gzip_ = false;
  bool ended_ = false;
  z_stream z_{};
};

}  // namespace

torch::Tensor read_idx_bytes(const void* bytes, size_t size, bool images, const std::string& name) {
  IdxReader f(bytes, size, name);
  const uint32_t magic = f.read_be32("the header");
  const uint32_t expected = images ? kImagesMagic : kLabelsMagic;
  TORCH_CHECK(magic == expected, "Fashion-MNIST: ", name, " has magic number ", magic,
              ", expected ", expected, " (", images ? "an idx3 image file" : "an idx1 label file",
              "): wrong or damaged file");
  const uint32_t count = f.read_be32("the header");
  std::vector<int64_t> shape{count};
  if (images) {
    const uint32_t rows = f.read_be32("the header");
    const uint32_t cols = f.read_be32("the header");
    TORCH_CHECK(rows == 28 && cols == 28, "Fashion-MNIST: ", name, " holds ", rows, "x", cols,
                " images, expected 28x28");
    shape.push_back(rows);
    shape.push_back(cols);
  }
  // The count in the header is only a claim: memory follows the data actually there, so that a
  // damaged count cannot ask for terabytes. The first guess, four times the input, holds all of a
  // plain file or of one gzip'd as well as Fashion-MNIST's (about 2:1); then it doubles as needed.
  const char* what = images ? "the image pixels" : "the labels";
  const size_t total = size_t{count} * (images ? 28 * 28 : 1);
  const size_t guess = std::max<size_t>(size_t{1} << 20, 4 * size);
  torch::Tensor data = torch::empty({static_cast<int64_t>(std::min(total, guess))}, torch::kUInt8);
  size_t done = 0;
  while (true) {
    const size_t want = static_cast<size_t>(data.numel()) - done;
    const size_t got = f.read_some(data.data_ptr<uint8_t>() + done, want, what);
    done += got;
    TORCH_CHECK(got == want, "Fashion-MNIST: ", name, " is truncated: it ends after ", done,
                " of the ", total, " bytes of ", what);
    if (done == total) {
      return data.view(shape);
    }
    torch::Tensor bigger =
        torch::empty({static_cast<int64_t>(std::min(total, 2 * done))}, torch::kUInt8);
    bigger.narrow(0, 0, static_cast<int64_t>(done)).copy_(data);
    data = bigger;
  }
}

torch::Tensor read_idx_file(const std::string& path, bool images) {
  struct stat st;
  // The dataset's root is the option that is wrong (a command line maps it to its flag).
  PARATRAIN_CHECK_OPTION(::stat(path.c_str(), &st) == 0, "root", "Fashion-MNIST: ", path,
                         " does not exist; install Debian's dataset-fashion-mnist or give root "
                         "the folder that holds its files");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const std::streamoff size = in.tellg();
  TORCH_CHECK(in.good() && size >= 0, "Fashion-MNIST: cannot open ", path);
  std::vector<char> bytes(static_cast<size_t>(size));
  in.seekg(0);
  TORCH_CHECK(in.read(bytes.data(), static_cast<std::streamsize>(bytes.size())),
              "Fashion-MNIST: cannot read ", path);
  return read_idx_bytes(bytes.data(), bytes.size(), images, path);
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
  if (out.size(1) == 3 && channels == 1) {
    return out.mean(1, /*keepdim=*/true);  // RGB to gray, for the 1-channel models
  }
  if (out.size(1) != channels) {
    TORCH_CHECK(out.size(1) == 1, "cannot turn ", out.size(1), "-channel images into ", channels,
                " channels (1-channel images are repeated, 3-channel ones averaged to 1)");
    out = out.expand({out.size(0), channels, out.size(2), out.size(3)}).contiguous();
  }
  return out;
}

}  // namespace data
}  // namespace paratrain
