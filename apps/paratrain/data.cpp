// paratrain data: dataset tools. make-imagefolder writes Fashion-MNIST as a real ImageFolder
// (JPEG, PNG and WebP files in class folders, train/ and val/), for trying ImageFolder training
// and for the data benchmark; tokenize writes a file's bytes as the token files a GPT trains on
// (train.bin and val.bin, nanoGPT's or llm.c's format).

#include "args.h"
#include "commands.h"
#include "train_options.h"

#include "paratrain/data/fashion_mnist.h"
#include "paratrain/data/make_image_folder.h"
#include "paratrain/data/tokens.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

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
    torch::Tensor images, labels;
    try {
      images = data::read_idx_file(prefix + "-images-idx3-ubyte.gz", true);
      labels = data::read_idx_file(prefix + "-labels-idx1-ubyte.gz", false);
    } catch (const OptionError& e) {  // the dataset's root is --data-dir
      throw std::runtime_error(
          train_detail::in_flags(e.what_without_backtrace(), {{"root", "data-dir"}}));
    }
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

const CommandSpec& tokenize_spec() {
  static const CommandSpec spec{
      "paratrain data tokenize",
      "Writes DIR/train.bin and DIR/val.bin from the bytes of FILE, one token per byte (a\n"
      "vocabulary of 256), the last --val-fraction of the file going to val.bin, as nanoGPT's\n"
      "shakespeare_char/prepare.py splits its text 90/10. Train a GPT on them with\n"
      "`paratrain train --model gpt ... --vocab 256 --dataset tokens --data-dir DIR`.",
      {
          {"bytes", "FILE", "the file to tokenize, any bytes (required)"},
          {"out", "DIR", "where train.bin and val.bin go (made if missing; required)"},
          {"val-fraction", "F", "the share of the file, from its end, for val.bin (default 0.1)"},
          {"format", "NAME", "nanogpt (raw uint16, the default) or llmc (llm.c's header first)"},
      }};
  return spec;
}

// --out, made if missing, and found writable before anything is written into it.
void make_out_dir(const std::string& out) {
  std::error_code ec;
  if (std::filesystem::exists(out, ec) && !std::filesystem::is_directory(out, ec)) {
    throw UsageError("--out " + out + " is a file, not a folder: give a folder for train.bin " +
                     "and val.bin");
  }
  std::filesystem::create_directories(out, ec);
  if (ec || ::access(out.c_str(), W_OK) != 0) {
    throw UsageError("cannot write --out " + out + ": " +
                     (ec ? ec.message() : std::string(std::strerror(errno))));
  }
}

int tokenize(const std::vector<std::string>& argv) {
  Args args(argv, tokenize_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (!args.has("bytes") || !args.has("out")) {
    throw UsageError("--bytes FILE and --out DIR are required");
  }
  const double val_fraction = args.get_double("val-fraction", 0.1);
  if (!(val_fraction > 0 && val_fraction < 1)) {
    throw UsageError("--val-fraction must be in (0, 1), got " + args.get("val-fraction"));
  }
  const std::string format = args.get("format", "nanogpt");
  if (format != "nanogpt" && format != "llmc") {
    throw UsageError("unknown --format '" + format + "': choose nanogpt or llmc");
  }
  // The input is read, and found to be a non-empty file (not a folder, not missing) that splits
  // into two non-empty parts, before --out is made: a refused command writes nothing.
  const std::string bytes = args.get("bytes");
  std::vector<uint16_t> tokens = data::read_byte_tokens(bytes);
  TORCH_CHECK(!tokens.empty(), bytes, " is empty: there is nothing to tokenize");
  const size_t n = tokens.size();
  // nanoGPT's split: train = data[:int(n * 0.9)], val = data[int(n * 0.9):].
  const auto n_train = static_cast<size_t>(static_cast<double>(n) * (1.0 - val_fraction));
  TORCH_CHECK(n_train > 0 && n_train < n, bytes, "'s ", n, " bytes leave ",
              n_train == 0 ? "train" : "val", " empty at --val-fraction ", val_fraction,
              ": give a larger file or another fraction");
  const std::string out = args.get("out");
  make_out_dir(out);
  const std::vector<uint16_t> val(tokens.begin() + static_cast<std::ptrdiff_t>(n_train),
                                  tokens.end());
  tokens.resize(n_train);
  data::write_tokens(out + "/train.bin", tokens, format);
  data::write_tokens(out + "/val.bin", val, format);
  std::cout << "paratrain data: wrote " << tokens.size() << " train and " << val.size()
            << " val tokens (bytes, vocab 256, " << format << ") to " << out << "/{train,val}.bin"
            << std::endl;
  return 0;
}

// `paratrain data <command>`.
const std::vector<Command>& data_commands() {
  static const std::vector<Command> table{
      {"make-imagefolder", "[opts]", "write Fashion-MNIST as an ImageFolder of JPEG/PNG/WebP",
       make_imagefolder},
      {"tokenize", "--bytes FILE --out DIR [opts]",
       "write a file's bytes as token files (train.bin, val.bin) for a GPT", tokenize},
  };
  return table;
}

}  // namespace

int run_data(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << help_text("paratrain data <command> [options]", "commands", data_commands());
    return args.empty() ? 2 : 0;
  }
  return dispatch(data_commands(), args[0], {args.begin() + 1, args.end()}, "data command");
}

}  // namespace cli
}  // namespace paratrain
