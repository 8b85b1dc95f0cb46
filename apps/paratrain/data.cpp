// paratrain data: dataset tools. make-imagefolder writes Fashion-MNIST as a real ImageFolder
// (JPEG, PNG and WebP files in class folders, train/ and val/), for trying ImageFolder training
// and for the data benchmark.

#include "args.h"
#include "commands.h"

#include "paratrain/data/fashion_mnist.h"
#include "paratrain/data/make_image_folder.h"

#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <tuple>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& data_spec() {
  static const CommandSpec spec{
      "paratrain data make-imagefolder",
      "Writes DIR/train/<class>/<i>.<ext> from Fashion-MNIST's training split and DIR/val/...\n"
      "from its test split: mostly RGB JPEGs of side --size (some 25%/50% larger, some wider),\n"
      "with grayscale JPEGs, RGB and RGBA PNGs and WebPs mixed in unless --jpeg-only.",
      {
          {"from", "NAME", "the source dataset: fashion-mnist (the default and only one)"},
          {"out", "DIR", "the new ImageFolder (required; must be new or empty)"},
          {"size", "N", "the images' side (default 64)"},
          {"train", "N", "the first N training images (default all; at least 100)"},
          {"val", "N", "the first N test images (default all; at least 100)"},
          {"data-dir", "DIR", "Fashion-MNIST's folder (default: Debian's)"},
          {"jpeg-only", "", "write JPEGs only"},
      }};
  return spec;
}

int make_imagefolder(const std::vector<std::string>& argv) {
  Args args(argv, data_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const std::string from = args.get("from", "fashion-mnist");
  if (from != "fashion-mnist") {
    throw UsageError("unknown --from '" + from + "': the source dataset is fashion-mnist");
  }
  if (!args.has("out")) {
    throw UsageError("--out DIR is required");
  }
  const int size = args.get_int("size", 64);
  const int train_n = args.get_int("train", -1);
  const int val_n = args.get_int("val", -1);
  if (size < 8) {
    throw UsageError("--size must be >= 8, got " + std::to_string(size));
  }
  // Fashion-MNIST's first 24 training and 20 test images do not cover all ten classes; an
  // ImageFolder refuses an empty class folder.
  if ((args.has("train") && train_n < 100) || (args.has("val") && val_n < 100)) {
    throw UsageError("--train and --val must be >= 100, so that every class has images");
  }
  const std::string out = args.get("out");
  {
    std::error_code ec;
    if (std::filesystem::exists(out, ec) && !std::filesystem::is_empty(out, ec)) {
      throw UsageError("--out " + out + " exists and is not empty: give a new folder (files " +
                       "of an earlier run would mix with these)");
    }
  }
  const std::string dir = args.get("data-dir", data::kFashionMnistDir);
  auto options = data::MakeImageFolderOptions().size(size).mixed(!args.has("jpeg-only"));
  const auto start = std::chrono::steady_clock::now();
  size_t written = 0;
  for (const auto& [split, name, count] :
       {std::make_tuple(std::string("train"), std::string("train"), train_n),
        std::make_tuple(std::string("t10k"), std::string("val"), val_n)}) {
    const std::string prefix = dir + "/" + split;
    torch::Tensor images = data::read_idx_file(prefix + "-images-idx3-ubyte.gz", true);
    torch::Tensor labels = data::read_idx_file(prefix + "-labels-idx1-ubyte.gz", false);
    const int64_t n = count < 0 ? images.size(0) : std::min<int64_t>(count, images.size(0));
    written +=
        data::write_image_folder(images.slice(0, 0, n), labels.slice(0, 0, n),
                                 data::fashion_mnist_class_folders(), out + "/" + name, options);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "paratrain data: wrote " << written << " images to " << out << "/{train,val} in "
            << seconds << " s" << std::endl;
  return 0;
}

}  // namespace

int run_data(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << "usage: paratrain data make-imagefolder [options]\n\n"
              << data_spec().description
              << "\n\nrun `paratrain data make-imagefolder --help` for its options\n";
    return args.empty() ? 2 : 0;
  }
  if (args[0] != "make-imagefolder") {
    throw UsageError("unknown data command '" + args[0] + "'; available: make-imagefolder");
  }
  return make_imagefolder({args.begin() + 1, args.end()});
}

}  // namespace cli
}  // namespace paratrain
