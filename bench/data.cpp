// paratrain bench data: how fast images come out of an ImageFolder, paratrain's DataLoader
// (worker threads, TurboJPEG/libpng/libwebp) against PyTorch's DataLoader with
// torchvision.datasets.ImageFolder (worker processes, PIL), on the same folder in the same run,
// for each anchor Python with torchvision (anchors.h: Debian's PyTorch 1.13.1, PyPI's 2.15.0).
// The target: paratrain's loader at least 2x the fastest PyTorch at each worker count.
//
// Both run RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize, batch 64,
// shuffled, one epoch over the folder per measurement, at each worker count; the rounds
// alternate paratrain and PyTorch so that both see the same machine, and a row is the median of
// --repeats rounds. A last row is the per-core ceiling: TurboJPEG decoding alone (the JPEG files
// already in memory, one thread). Without --dir the folder is made from Fashion-MNIST
// (--images of them, side --size, as `paratrain data make-imagefolder`) in a temporary folder.

#include "anchors.h"
#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"
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

std::vector<int64_t> worker_counts(const Bench& bench) {
  std::vector<int64_t> out;
  std::stringstream s(bench.get("workers", "1,2"));
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

const BenchSpec& data_spec() {
  static const BenchSpec spec{
      "data",
      "ImageFolder images/s: paratrain's loader against PyTorch's DataLoader with PIL.",
      {
          {"dir", "IMAGEFOLDER", "an ImageFolder to read (default: one made of Fashion-MNIST)"},
          {"images", "N", "images in the made ImageFolder (default 2000)", "100"},
          {"size", "N", "their side (default 64)", "16"},
          {"workers", "LIST", "the loader threads to compare (default 1,2)", "1"},
          {"repeats", "N", "passes per setting (default 3)", "1"},
          {"batch-size,batch", "B", "batch size (default 64)", "16"},
          {"crop", "N", "RandomResizedCrop's size (default 224)", "32"},
          {"no-pytorch", "", "skip PyTorch's DataLoader"},
          {"python", "LIST", anchor_pythons_help("with torch and torchvision")},
      },
      "print JSON"};
  return spec;
}

// What every round reads, and how.
struct DataPlan {
  int repeats = 0, batch = 0, crop = 0, images = 0, size = 0;
  std::vector<int64_t> workers;
  std::vector<AnchorPython> anchors;  // empty when PyTorch's loader is skipped
  std::string script;
};

DataPlan data_plan(const Bench& bench) {
  DataPlan p;
  p.repeats = bench.get_int("repeats", 3);
  p.batch = bench.get_int("batch-size", 64);
  p.crop = bench.get_int("crop", 224);
  p.images = bench.get_int("images", 2000);
  p.size = bench.get_int("size", 64);
  if (p.repeats < 1 || p.batch < 1 || p.crop < 1 || p.images < 100 || p.size < 8) {
    throw UsageError(
        "--repeats, --batch-size and --crop must be >= 1, --images >= 100 (every class "
        "then has images), --size >= 8");
  }
  p.workers = worker_counts(bench);
  p.anchors = anchors_with(bench, anchor_pythons(bench), "torchvision");
  p.script = p.anchors.empty() ? "" : bench_script("data_pytorch.py");
  return p;
}

// An ImageFolder of the first `images` Fashion-MNIST training images, side `size`, at `path`.
void make_folder(const Bench& bench, const DataPlan& p, const std::string& path) {
  bench.info() << "making an ImageFolder of " << p.images << " Fashion-MNIST images (side "
               << p.size << ") in " << path << std::endl;
  const std::string prefix = std::string(data::kFashionMnistDir) + "/train-";
  torch::Tensor raw = data::read_idx_file(prefix + "images-idx3-ubyte.gz", true);
  torch::Tensor labels = data::read_idx_file(prefix + "labels-idx1-ubyte.gz", false);
  data::write_image_folder(raw.slice(0, 0, p.images), labels.slice(0, 0, p.images),
                           data::fashion_mnist_class_folders(), path,
                           data::MakeImageFolderOptions().size(p.size));
}

using Rates = std::map<std::pair<std::string, int64_t>, std::vector<double>>;

// One epoch of PyTorch's loader under anchor `a`, its row appended to `out`.
void pytorch_epoch(const DataPlan& p,
                   const AnchorPython& a,
                   const std::string& dir,
                   int64_t w,
                   int round,
                   const std::string& out) {
  const std::string cmd = "'" + a.python + "' '" + p.script + "' --dir '" + dir + "' --workers " +
                          std::to_string(w) + " --batch " + std::to_string(p.batch) + " --crop " +
                          std::to_string(p.crop) + " --repeat " + std::to_string(round) +
                          " --system " + a.label() + " --out '" + out + "'";
  if (std::system(cmd.c_str()) != 0) {
    throw std::runtime_error("PyTorch " + a.torch + "'s loader failed: " + cmd);
  }
}

// The rounds, paratrain and each PyTorch alternating at each worker count: images/s by (system,
// workers), one entry per round.
Rates measure_rates(const Bench& bench, const DataPlan& p, const std::string& dir) {
  const std::string out = results_file("data-rows");
  Rates rates;
  try {
    for (int r = 0; r < p.repeats; ++r) {
      for (int64_t w : p.workers) {
        rates[{"paratrain", w}].push_back(
            paratrain_epoch(dir, w, p.batch, p.crop, static_cast<uint64_t>(r)));
        for (const auto& a : p.anchors) {
          pytorch_epoch(p, a, dir, w, r, out);
        }
        bench.info() << "round " << r + 1 << "/" << p.repeats << ", " << w << " worker(s) done"
                     << std::endl;
      }
    }
    for (const JsonRow& row : read_rows(out)) {
      rates[{string_field(row, "system"), static_cast<int64_t>(number_field(row, "workers"))}]
          .push_back(number_field(row, "images_per_second"));
    }
  } catch (...) {
    std::remove(out.c_str());
    throw;
  }
  std::remove(out.c_str());
  return rates;
}

// paratrain's row at `w` workers, with its ratio to each PyTorch, and the target against the
// fastest of them.
JsonRow paratrain_row(
    const Bench& bench, const DataPlan& p, Rates& rates, int64_t w, std::vector<Target>& targets) {
  const double ips = median(rates[{"paratrain", w}]);
  JsonRow row{
      {"system", "paratrain"}, {"workers", w}, {"images_per_second", ips}, {"repeats", p.repeats}};
  std::string fastest;
  double fastest_ips = 0;
  for (const auto& a : p.anchors) {
    const double theirs = median(rates[{a.label(), w}]);
    row["ratio_to_" + a.label()] = ips / theirs;
    if (theirs > fastest_ips) {
      fastest = a.label();
      fastest_ips = theirs;
    }
  }
  if (fastest.empty()) {
    note_smoke_skip(bench, row);
  } else {
    row["ratio_to_pytorch"] = ips / fastest_ips;
    row["fastest_pytorch"] = fastest;
    targets.push_back({"loader " + std::to_string(w) + " worker(s)",
                       fastest,
                       {{"ratio", ips / fastest_ips, 2.0, false}}});
  }
  return row;
}

void print_rates(const Bench& bench, const DataPlan& p, Rates& rates, double ceiling) {
  std::vector<Target> targets;
  for (int64_t w : p.workers) {
    std::vector<JsonRow> rows{paratrain_row(bench, p, rates, w, targets)};
    for (const auto& a : p.anchors) {
      JsonRow row{{"system", a.label()},
                  {"workers", w},
                  {"images_per_second", median(rates[{a.label(), w}])},
                  {"repeats", p.repeats}};
      mark_anchor(row, a, a.torch + " (torchvision " + a.package("torchvision") + ")");
      rows.push_back(row);
    }
    for (const auto& row : rows) {
      if (bench.json()) {
        print_row(row);
        continue;
      }
      const std::string system = string_field(row, "system");
      std::cout << std::left << std::setw(16) << system << " workers " << w << ": " << std::fixed
                << std::setprecision(0) << number_field(row, "images_per_second") << " images/s";
      if (row.contains("ratio_to_pytorch")) {
        std::cout << std::setprecision(2) << " (" << number_field(row, "ratio_to_pytorch") << "x "
                  << string_field(row, "fastest_pytorch") << ", the fastest PyTorch)";
      }
      std::cout << std::endl;
    }
  }
  if (bench.json()) {
    print_row({{"system", "turbojpeg-decode"}, {"workers", 1}, {"images_per_second", ceiling}});
  } else {
    std::cout << "decode alone (1 thread, files in memory): " << std::fixed << std::setprecision(0)
              << ceiling << " images/s" << std::endl;
  }
  for (const auto& t : targets) {
    print_target(bench, t);
  }
  std::cout.flush();
}

int run_data_bench(const Bench& bench) {
  const DataPlan p = data_plan(bench);
  std::string dir = bench.get("dir", "");
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
    make_folder(bench, p, made);
    dir = made;
  }
  Rates rates = measure_rates(bench, p, dir);
  print_rates(bench, p, rates, decode_ceiling(dir));
  return 0;
}

}  // namespace

int run_bench_data(const std::vector<std::string>& argv) {
  return run_benchmark(data_spec(), argv, run_data_bench);
}

}  // namespace cli
}  // namespace paratrain
