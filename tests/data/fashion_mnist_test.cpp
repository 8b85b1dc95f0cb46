// Fashion-MNIST: the real files from Debian's package, and damaged files made here.

#include "test_util.h"

#include "paratrain/base/option_error.h"
#include "paratrain/data/fashion_mnist.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <unistd.h>

#include <cstdio>

namespace paratrain {
namespace data {
namespace {

using paratrain::testing::error_of;

// Writes a gzip'd idx file: big-endian header words, then `payload` bytes.
void write_idx(const std::string& path, std::vector<uint32_t> header, size_t payload) {
  gzFile f = gzopen(path.c_str(), "wb");
  for (uint32_t w : header) {
    unsigned char b[4] = {static_cast<unsigned char>(w >> 24), static_cast<unsigned char>(w >> 16),
                          static_cast<unsigned char>(w >> 8), static_cast<unsigned char>(w)};
    gzwrite(f, b, 4);
  }
  std::vector<unsigned char> data(payload, 3);
  if (!data.empty()) {
    gzwrite(f, data.data(), static_cast<unsigned>(data.size()));
  }
  gzclose(f);
}

TEST(FashionMNIST, ReadsDebiansFiles) {
  FashionMNIST train(kFashionMnistDir, FashionMNIST::Split::kTrain);
  FashionMNIST test(kFashionMnistDir, FashionMNIST::Split::kTest);
  EXPECT_EQ(*train.size(), 60000u);
  EXPECT_EQ(*test.size(), 10000u);
  EXPECT_EQ(train.images().sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(train.targets().min().item<int64_t>(), 0);
  EXPECT_EQ(train.targets().max().item<int64_t>(), 9);
  // Normalised: the training set's mean and std come out near 0 and 1.
  EXPECT_NEAR(train.images().mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(train.images().std().item<double>(), 1.0, 0.01);
  // Balanced classes: 6000 of each in training.
  EXPECT_EQ(train.targets().eq(3).sum().item<int64_t>(), 6000);
  auto example = train.get(0);
  EXPECT_EQ(example.data.sizes(), (std::vector<int64_t>{1, 28, 28}));
}

TEST(FashionMNIST, MissingFilesSayWhatToInstall) {
  std::string message = error_of([] { FashionMNIST("/nonexistent-dir"); });
  EXPECT_NE(message.find("/nonexistent-dir/train-images-idx3-ubyte.gz does not exist; install "
                         "Debian's dataset-fashion-mnist or give root the folder that holds its "
                         "files"),
            std::string::npos)
      << message;
  // An option error naming the dataset's root, which a command line maps to its flag.
  try {
    FashionMNIST("/nonexistent-dir");
    ADD_FAILURE() << "no error";
  } catch (const paratrain::OptionError& e) {
    EXPECT_EQ(e.field(), "root");
  }
}

TEST(FashionMNIST, BadMagicAndTruncatedFiles) {
  char tmpl[] = "/tmp/paratrain-fmnist-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  // Labels where images should be: wrong magic.
  write_idx(dir + "/train-images-idx3-ubyte.gz", {2049, 10}, 10);
  std::string message = error_of([&] { FashionMNIST ds(dir); });
  EXPECT_NE(message.find("train-images-idx3-ubyte.gz has magic number 2049, expected 2051"),
            std::string::npos)
      << message;
  // Right header, but the pixels stop early.
  write_idx(dir + "/train-images-idx3-ubyte.gz", {2051, 10, 28, 28}, 28 * 28 * 10 - 100);
  write_idx(dir + "/train-labels-idx1-ubyte.gz", {2049, 10}, 10);
  message = error_of([&] { FashionMNIST ds(dir); });
  EXPECT_NE(message.find("train-images-idx3-ubyte.gz is truncated: it ends after 7740 of the 7840 "
                         "bytes of the image pixels"),
            std::string::npos)
      << message;
  // A header cut short.
  write_idx(dir + "/train-images-idx3-ubyte.gz", {2051}, 0);
  message = error_of([&] { FashionMNIST ds(dir); });
  EXPECT_NE(message.find("is truncated"), std::string::npos) << message;
  // Counts that disagree.
  write_idx(dir + "/train-images-idx3-ubyte.gz", {2051, 10, 28, 28}, 28 * 28 * 10);
  write_idx(dir + "/train-labels-idx1-ubyte.gz", {2049, 9}, 9);
  message = error_of([&] { FashionMNIST ds(dir); });
  EXPECT_NE(message.find("holds 10 images but"), std::string::npos) << message;
  // And a good small file pair loads.
  write_idx(dir + "/train-labels-idx1-ubyte.gz", {2049, 10}, 10);
  FashionMNIST small(dir);
  EXPECT_EQ(*small.size(), 10u);
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

TEST(AdaptImages, ResizesAndRepeatsChannels) {
  auto batch = torch::rand({2, 1, 28, 28});
  auto out = data::adapt_images(batch, 32, 3);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 32, 32}));
  EXPECT_TRUE(torch::equal(out[0][0], out[0][2]));
  // Bilinear resizing keeps a constant image constant.
  auto flat = data::adapt_images(torch::full({1, 1, 28, 28}, 0.25), 32, 1);
  EXPECT_LE((flat - 0.25).abs().max().item<double>(), 1e-6);
  EXPECT_TRUE(data::adapt_images(batch, 28, 1).is_same(batch));
  EXPECT_THROW(data::adapt_images(torch::rand({1, 2, 28, 28}), 28, 3), c10::Error);
}

}  // namespace
}  // namespace data
}  // namespace paratrain
