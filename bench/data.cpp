// paratrain bench data: how fast images come out of an ImageFolder, paratrain's DataLoader
// (worker threads, TurboJPEG/libpng/libwebp) against PyTorch's DataLoader with
// torchvision.datasets.ImageFolder (worker processes, PIL), on the same folder in the same run.
//
// Both run RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize, batch 64,
// shuffled, one epoch over the folder per measurement, at each worker count; the rounds
// alternate paratrain and PyTorch so that both see the same machine, and a row is the median of
// --repeats rounds. A last row is the per-core ceiling: TurboJPEG decoding alone (the JPEG files
// already in memory, one thread). Without --dir the folder is made from Fashion-MNIST
// (--images of them, side --size, as `paratrain data make-imagefolder`) in a temporary folder.

#include "args.h"
#include "bench_util.h"
#include "commands.h"
#include "util/files.h"

#include "paratrain/data/dataset.h"
#include "paratrain/data/fashion_mnist.h"
#include "paratrain/data/image.h"
#include "paratrain/data/loader.h"
#include "paratrain/data/make_image_folder.h"
#include "paratrain/data/transforms.h"

#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double paratrain_epoch(
    const std::string& dir, int64_t workers, int batch, int crop, uint64_t epoch) {
  namespace T = data::transforms;
  auto transform = T::compose(T::RandomResizedCrop(crop), T::RandomHorizontalFlip(), T::ToTensor(),
                              T::Normalize({0.485, 0.456, 0.406}, {0.229, 0.224, 0.225}));
  const auto start = Clock::now();
  // Full-size decoding, as PIL's: DCT-scaled decoding (draft) would not be the same work.
  auto dataset =
      std::make_shared<data::ImageFolder>(dir, transform, data::ImageDatasetOptions().draft(false));
  data::DataLoader loader(
      dataset,
      data::LoaderOptions(static_cast<size_t>(batch)).workers(workers).shuffle(true).seed(epoch));
  size_t images = 0;
  while (auto b = loader.next()) {
    images += static_cast<size_t>(b->data.size(0));
  }
  return static_cast<double>(images) / seconds_since(start);
}

double decode_ceiling(const std::string& dir) {
  data::ImageFolder folder(dir);
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& s : folder.samples()) {
    std::string bytes = data::read_file(s.first);
    if (data::sniff_image_format(bytes.data(), bytes.size()) == data::ImageFormat::kJpeg) {
      files.emplace_back(s.first, std::move(bytes));
    }
  }
  if (files.empty()) {
    return 0;
  }
  const auto start = Clock::now();
  for (const auto& [path, bytes] : files) {
    data::decode_image(bytes, path);
  }
  return static_cast<double>(files.size()) / seconds_since(start);
}

std::vector<int64_t> worker_counts(const Args& args) {
  std::vector<int64_t> out;
  std::stringstream s(args.get("workers", "1,2"));
  for (std::string w; std::getline(s, w, ',');) {
    try {
      out.push_back(std::stoll(w));
    } catch (const std::exception&) {
      throw UsageError("--workers takes a comma-separated list of counts, got '" + w + "'");
    }
    if (out.back() < 1) {
      throw UsageError("--workers counts must be >= 1, got " + w);
    }
  }
  return out;
}

}  // namespace

int run_bench_data(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain bench data",
      "ImageFolder images/s: paratrain's loader against PyTorch's DataLoader with PIL.",
      {
          {"dir", "IMAGEFOLDER", "an ImageFolder to read (default: one made of Fashion-MNIST)"},
          {"images", "N", "images in the made ImageFolder (default 2000)"},
          {"size", "N", "their side (default 64)"},
          {"workers", "LIST", "the loader threads to compare (default 1,2)"},
          {"repeats", "N", "passes per setting (default 3)"},
          {"batch", "B", "batch size (default 64)"},
          {"crop", "N", "RandomResizedCrop's size (default 224)"},
          {"no-pytorch", "", "skip PyTorch's DataLoader"},
          {"python", "P", "the Python with torch (default: python3 or /usr/bin/python3)"},
          {"json", "", "print JSON"},
      }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const bool json = args.has("json");
  const bool pytorch = !args.has("no-pytorch");
  const int repeats = args.get_int("repeats", 3);
  const int batch = args.get_int("batch", 64);
  const int crop = args.get_int("crop", 224);
  const int images = args.get_int("images", 2000);
  const int size = args.get_int("size", 64);
  if (repeats < 1 || batch < 1 || crop < 1 || images < 100 || size < 8) {
    throw UsageError(
        "--repeats, --batch and --crop must be >= 1, --images >= 100 (every class "
        "then has images), --size >= 8");
  }
  const auto workers = worker_counts(args);
  const std::string python = pytorch ? torch_python(args.get("python", "")) : "";
  const std::string script = pytorch ? bench_script("data_pytorch.py") : "";
  std::ostream& log = json ? std::cerr : std::cout;

  std::string dir = args.get("dir", "");
  std::string made;
  // Removes the folder made here on every way out.
  struct RemoveMade {
    const std::string& path;
    ~RemoveMade() {
      if (!path.empty()) {
        detail::remove_tree(path);
      }
    }
  } remove_made{made};
  if (dir.empty()) {
    made = results_file("data");  // a unique name; the folder replaces the file
    fs::remove(made);
    log << "making an ImageFolder of " << images << " Fashion-MNIST images (side " << size
        << ") in " << made << std::endl;
    const std::string prefix = std::string(data::kFashionMnistDir) + "/train-";
    torch::Tensor raw = data::read_idx_file(prefix + "images-idx3-ubyte.gz", true);
    torch::Tensor labels = data::read_idx_file(prefix + "labels-idx1-ubyte.gz", false);
    data::write_image_folder(raw.slice(0, 0, images), labels.slice(0, 0, images),
                             data::fashion_mnist_class_folders(), made,
                             data::MakeImageFolderOptions().size(size));
    dir = made;
  }
  const std::string out = results_file("data-rows");
  std::map<std::pair<std::string, int64_t>, std::vector<double>> rates;
  try {
    for (int r = 0; r < repeats; ++r) {
      for (int64_t w : workers) {
        rates[{"paratrain", w}].push_back(
            paratrain_epoch(dir, w, batch, crop, static_cast<uint64_t>(r)));
        if (pytorch) {
          const std::string cmd = "'" + python + "' '" + script + "' --dir '" + dir +
                                  "' --workers " + std::to_string(w) + " --batch " +
                                  std::to_string(batch) + " --crop " + std::to_string(crop) +
                                  " --repeat " + std::to_string(r) + " --out '" + out + "'";
          if (std::system(cmd.c_str()) != 0) {
            throw std::runtime_error("the PyTorch loader failed: " + cmd);
          }
        }
        log << "round " << r + 1 << "/" << repeats << ", " << w << " worker(s) done" << std::endl;
      }
    }
    std::ifstream in(out);
    for (std::string line; std::getline(in, line);) {
      rates[{"pytorch", std::stoll(json_field(line, "workers"))}].push_back(
          std::stod(json_field(line, "images_per_second")));
    }
  } catch (...) {
    std::remove(out.c_str());
    throw;
  }
  std::remove(out.c_str());
  const double ceiling = decode_ceiling(dir);
  for (int64_t w : workers) {
    for (const std::string system : {"paratrain", "pytorch"}) {
      if (!rates.count({system, w})) {
        continue;
      }
      const double ips = median(rates[{system, w}]);
      std::map<std::string, std::string> row{{"system", quoted(system)},
                                             {"workers", std::to_string(w)},
                                             {"images_per_second", std::to_string(ips)},
                                             {"repeats", std::to_string(repeats)}};
      if (system == "paratrain" && rates.count({"pytorch", w})) {
        row["ratio_to_pytorch"] = std::to_string(ips / median(rates[{"pytorch", w}]));
      }
      if (json) {
        std::cout << row_json(row) << std::endl;
      } else {
        std::cout << std::left << std::setw(10) << system << " workers " << w << ": " << std::fixed
                  << std::setprecision(0) << ips << " images/s"
                  << (row.count("ratio_to_pytorch")
                          ? " (" + row["ratio_to_pytorch"].substr(0, 4) + "x PyTorch)"
                          : "")
                  << std::endl;
      }
    }
  }
  if (json) {
    std::cout << row_json({{"system", quoted("turbojpeg-decode")},
                           {"workers", "1"},
                           {"images_per_second", std::to_string(ceiling)}})
              << std::endl;
  } else {
    std::cout << "decode alone (1 thread, files in memory): " << std::fixed << std::setprecision(0)
              << ceiling << " images/s" << std::endl;
  }
  return 0;
}

}  // namespace cli
}  // namespace paratrain
