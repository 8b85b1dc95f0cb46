// ImageFolder and ImageList on real files made from Fashion-MNIST (JPEG, grayscale JPEG, PNG,
// RGBA PNG, WebP, several sizes), torchvision's folder rules, every bad input named
// in its error, and `paratrain train --dataset imagefolder` training with DDP on 2 ranks until it
// clearly beats chance.

#include "paratrain/data/dataset.h"
#include "paratrain/data/fashion_mnist.h"
#include "paratrain/data/image.h"
#include "paratrain/data/loader.h"
#include "paratrain/data/make_image_folder.h"
#include "paratrain/data/transforms.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <regex>

namespace paratrain {
namespace {

using namespace testing;
namespace fs = std::filesystem;
namespace T = data::transforms;

// root/{train,val}: n and n / 4 Fashion-MNIST images at side `size`, mixed formats.
std::string make_folder(const std::string& name, int64_t n, int64_t size = 32) {
  const std::string root = "/tmp/" + unique_token(name);
  const std::string dir = data::kFashionMnistDir;
  for (const auto& [split, sub, count] :
       {std::make_tuple("train", "train", n), std::make_tuple("t10k", "val", n / 4)}) {
    torch::Tensor images =
        data::read_idx_file(dir + "/" + split + "-images-idx3-ubyte.gz", true).slice(0, 0, count);
    torch::Tensor labels =
        data::read_idx_file(dir + "/" + split + "-labels-idx1-ubyte.gz", false).slice(0, 0, count);
    data::write_image_folder(images, labels, data::fashion_mnist_class_folders(), root + "/" + sub,
                             data::MakeImageFolderOptions().size(size));
  }
  return root;
}

TEST(ImageFolder, FollowsTorchvisionsRules) {
  const std::string root = make_folder("if-rules", 80);
  const std::string train = root + "/train";
  // Files torchvision ignores, and one it finds in a nested folder.
  data::write_file(train + "/3_dress/notes.txt", "not an image, ignored by extension\n");
  fs::create_directories(train + "/3_dress/more");
  data::write_file(train + "/3_dress/more/extra.PNG",
                   data::encode_png(torch::full({3, 20, 30}, 77, torch::kUInt8)));
  data::ImageFolder folder(train);
  EXPECT_EQ(folder.classes(), data::fashion_mnist_class_folders());
  EXPECT_EQ(folder.class_to_idx().at("3_dress"), 3);
  EXPECT_EQ(folder.size(), 81u);
  // Sorted as torchvision's sorted(os.walk()): folder by folder, names sorted in each.
  std::vector<std::string> dress;
  for (const auto& [path, label] : folder.samples()) {
    if (label == 3) {
      dress.push_back(path.substr(train.size() + 9));
    }
  }
  ASSERT_FALSE(dress.empty());
  EXPECT_EQ(dress.back(), "more/extra.PNG");
  EXPECT_TRUE(std::is_sorted(dress.begin(), dress.end() - 1));
  // Labels match Fashion-MNIST's (class folders are numbered); every image decodes to RGB.
  torch::Tensor labels = data::read_idx_file(
      std::string(data::kFashionMnistDir) + "/train-labels-idx1-ubyte.gz", false);
  for (size_t i = 0; i < folder.size(); ++i) {
    const auto& [path, label] = folder.samples()[i];
    if (path.find("extra") == std::string::npos) {
      const auto stem = std::stoll(fs::path(path).stem().string());
      EXPECT_EQ(label, labels[stem].item<int64_t>()) << path;
    }
    auto s = folder.get(i);
    EXPECT_EQ(s.data.size(0), 3) << path;
    EXPECT_EQ(s.data.scalar_type(), torch::kUInt8);
    EXPECT_EQ(s.target.item<int64_t>(), label);
  }
  // Through the loader with the ImageNet training recipe.
  auto recipe = std::make_shared<data::ImageFolder>(
      train, T::compose(T::RandomResizedCrop(24), T::RandomHorizontalFlip(), T::ToTensor(),
                        T::Normalize({0.5, 0.5, 0.5}, {0.25, 0.25, 0.25})));
  data::DataLoader loader(recipe, data::LoaderOptions(16).workers(2).shuffle(true));
  size_t seen = 0;
  while (auto b = loader.next()) {
    EXPECT_EQ(b->data.sizes().slice(1), torch::IntArrayRef({3, 24, 24}));
    seen += static_cast<size_t>(b->data.size(0));
  }
  EXPECT_EQ(seen, 81u);
  remove_tree(root);
}

TEST(ImageFolder, BadFoldersAreNamed) {
  const std::string root = "/tmp/" + unique_token("if-bad");
  std::string e = error_of([&] { data::ImageFolder f(root + "/nothing"); });
  EXPECT_NE(e.find("ImageFolder: root " + root + "/nothing does not exist"), std::string::npos)
      << e;
  fs::create_directories(root + "/flat");
  data::write_file(root + "/flat/a.jpg", data::encode_jpeg(torch::zeros({3, 8, 8}, torch::kUInt8)));
  e = error_of([&] { data::ImageFolder f(root + "/flat"); });
  EXPECT_NE(e.find("ImageFolder: no class folder in " + root + "/flat"), std::string::npos) << e;
  fs::create_directories(root + "/flat/cat");
  fs::create_directories(root + "/flat/dog");
  data::write_file(root + "/flat/cat/a.jpg",
                   data::encode_jpeg(torch::zeros({3, 8, 8}, torch::kUInt8)));
  data::write_file(root + "/flat/dog/readme.txt", "no images here");
  e = error_of([&] { data::ImageFolder f(root + "/flat"); });
  EXPECT_NE(e.find("ImageFolder: class folder " + root + "/flat/dog holds no image"),
            std::string::npos)
      << e;
  remove_tree(root);
}

TEST(ImageFolder, BadFilesAreNamedOrSkipped) {
  const std::string root = make_folder("if-files", 40);
  const std::string train = root + "/train";
  const std::string jpeg = data::encode_jpeg(
      torch::randint(0, 256, {3, 64, 64}, torch::kUInt8));  // noise: the cut falls in the scan
  data::write_file(train + "/1_trouser/zz_cut.jpg", jpeg.substr(0, jpeg.size() / 2));
  data::write_file(train + "/2_pullover/zz_text.png", "plain text with an image's name\n");
  auto transform = T::compose(T::Resize(32), T::CenterCrop(32), T::ToTensor());
  auto folder = std::make_shared<data::ImageFolder>(train, transform);
  ASSERT_EQ(folder->size(), 42u);
  std::string e = error_of([&] {
    data::DataLoader loader(folder, data::LoaderOptions(8).workers(2));
    while (loader.next()) {
    }
  });
  EXPECT_TRUE(e.find(train + "/1_trouser/zz_cut.jpg: truncated JPEG") != std::string::npos ||
              e.find(train + "/2_pullover/zz_text.png: not a JPEG, PNG or WebP file") !=
                  std::string::npos)
      << e;
  EXPECT_NE(e.find("DataLoader: sample "), std::string::npos) << e;

  data::DataLoader skipping(folder, data::LoaderOptions(8).workers(2).skip_bad_samples(true));
  size_t seen = 0;
  while (auto b = skipping.next()) {
    seen += static_cast<size_t>(b->data.size(0));
  }
  EXPECT_EQ(seen, 40u);
  auto bad = skipping.bad_samples();
  ASSERT_EQ(bad.size(), 2u);
  EXPECT_EQ(bad[0].what, train + "/1_trouser/zz_cut.jpg");
  EXPECT_EQ(bad[1].what, train + "/2_pullover/zz_text.png");

  // An image smaller than the crop, with no resize before it.
  auto crop_only = std::make_shared<data::ImageFolder>(train, T::compose(T::CenterCrop(200)));
  e = error_of([&] {
    data::DataLoader loader(crop_only, data::LoaderOptions(4));
    loader.next();
  });
  EXPECT_NE(e.find("CenterCrop(200): the image is"), std::string::npos) << e;
  EXPECT_NE(e.find(train + "/0_t-shirt_top/"), std::string::npos) << e;
  remove_tree(root);
}

TEST(ImageList, ReadsPathsAndLabels) {
  const std::string root = "/tmp/" + unique_token("il");
  fs::create_directories(root + "/img");
  for (int i = 0; i < 3; ++i) {
    data::write_file(root + "/img/p " + std::to_string(i) + ".png",
                     data::encode_png(torch::full({3, 6, 6}, i * 50, torch::kUInt8)));
  }
  std::ofstream(root + "/list.txt") << "# path label\nimg/p 0.png 4\n\n"
                                    << root << "/img/p 1.png 0\nimg/p 2.png\t2\n";
  data::ImageList list(root + "/list.txt");
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list.samples()[0].first, root + "/img/p 0.png");
  EXPECT_EQ(list.samples()[0].second, 4);
  EXPECT_EQ(list.get(2).data[0][0][0].item<int>(), 100);
  EXPECT_EQ(list.get(2).target.item<int64_t>(), 2);
  std::ofstream(root + "/bad.txt") << "img/p 0.png 1\nimg/p 1.png one\n";
  std::string e = error_of([&] { data::ImageList l(root + "/bad.txt"); });
  EXPECT_NE(e.find("ImageList: " + root + "/bad.txt line 2: expected '<path> <label>'"),
            std::string::npos)
      << e;
  e = error_of([&] { data::ImageList l(root + "/missing.txt"); });
  EXPECT_NE(e.find("ImageList: cannot read " + root + "/missing.txt"), std::string::npos) << e;
  remove_tree(root);
}

TEST(ImageFolder, CliMakesAFolderAndTrainsOnItWithDdp) {  // ctest: slow 18
  const std::string root = "/tmp/" + unique_token("if-cli");
  auto made = run_process({cli_path(), "data", "make-imagefolder", "--from", "fashion-mnist",
                           "--out", root, "--size", "32", "--train", "3000", "--val", "500"},
                          {}, 300);
  ASSERT_EQ(made.exit_code, 0) << made.output;
  EXPECT_NE(made.output.find("wrote 3500 images"), std::string::npos) << made.output;
  auto r = run_process({cli_path(),    "train",      "--model",   "cnn",          "--dataset",
                        "imagefolder", "--data-dir", root,        "--strategy",   "ddp",
                        "--nproc",     "2",          "--backend", "gloo",         "--device",
                        "cpu",         "--epochs",   "3",         "--batch-size", "32",
                        "--workers",   "1",          "--lr",      "0.05",         "--json"},
                       world_of_one_env(), 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto at = r.output.rfind("\"test_accuracy\": ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double accuracy = std::stod(r.output.substr(at + 17));
  EXPECT_GT(accuracy, 0.4) << r.output;  // chance is 0.1
  EXPECT_NE(r.output.find("\"data_wait_seconds\": "), std::string::npos) << r.output;

  // The example: PyTorch's ImageNet example's main_worker on the same folder, 2 ranks through the
  // launcher, on the CPU (it takes the GPU of its local rank where there are GPUs, and a machine
  // with one GPU refuses 2 ranks).
  auto cpu_only = world_of_one_env();
  cpu_only.insert(kCpuOnly);
  r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                   PARATRAIN_TEST_IMAGEFOLDER_EXAMPLE, root, "1", "cnn", "28"},
                  cpu_only, 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(val accuracy ([0-9.]+))"))) << r.output;
  EXPECT_GT(std::stod(m[1]), 0.3) << r.output;

  // Bad input: one line naming the path, non-zero exit.
  data::write_file(root + "/train/4_coat/zz_text.jpg", "not a JPEG\n");
  r = run_process({cli_path(), "train", "--model", "cnn", "--dataset", "imagefolder", "--data-dir",
                   root, "--epochs", "1", "--workers", "2"},
                  world_of_one_env(), 300);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot decode " + root + "/train/4_coat/zz_text.jpg: not a JPEG"),
            std::string::npos)
      << r.output;
  r = run_cli({cli_path(), "train", "--model", "cnn", "--dataset", "imagefolder", "--data-dir",
               root + "/nope"},
              world_of_one_env());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("ImageFolder: root " + root + "/nope/train does not exist"),
            std::string::npos)
      << r.output;
  r = run_cli({cli_path(), "train", "--model", "cnn", "--dataset", "imagefolder", "--data-dir",
               root, "--workers", "-1"},
              world_of_one_env());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--workers must be >= 0, got -1"), std::string::npos) << r.output;
  remove_tree(root);
}

}  // namespace
}  // namespace paratrain
