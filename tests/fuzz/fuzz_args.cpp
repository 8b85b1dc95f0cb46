// libFuzzer target: the command-line reader. The input is a list of words separated by NUL or
// newline bytes, read with `paratrain train`'s options (and `launch`'s) through CLI11, then every
// getter is asked for every option. Bad command lines must throw UsageError and nothing else.

#include "args.h"

#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

namespace {

const std::set<std::string> kValued = {
    "model",   "dataset",        "strategy",     "nproc",        "backend",      "epochs",
    "steps",   "batch-size",     "lr",           "momentum",     "weight-decay", "seed",
    "workers", "data-dir",       "save-weights", "load-weights", "devices",      "stages",
    "chunks",  "schedule",       "amp",          "amp-dtype",    "image-size",   "channels",
    "head",    "nproc-per-node", "master-port",  "log-dir",      "env",          "size",
};
const std::set<std::string> kFlags = {"json", "help", "freeze-backbone", "standalone", "no-prefix"};

std::vector<std::string> split_words(const uint8_t* data, size_t size) {
  std::vector<std::string> words(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\0' || data[i] == '\n') {
      words.emplace_back();
    } else {
      words.back() += static_cast<char>(data[i]);
    }
  }
  return words;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using paratrain::cli::Args;
  using paratrain::cli::UsageError;
  const std::vector<std::string> words = split_words(data, size);
  for (const std::string& word : words) {
    if (word.find("config") != std::string::npos) {
      return 0;  // --config reads a file: the fuzzer must not open /dev/zero or the like
    }
  }
  static const paratrain::cli::CommandSpec spec = [] {
    paratrain::cli::CommandSpec s{
        "paratrain fuzz", "the options of train and launch", {}, "", true};
    for (const std::string& name : kValued) {
      s.options.push_back({name, "V", "a valued option"});
    }
    for (const std::string& name : kFlags) {
      if (name != "help") {
        s.options.push_back({name, "", "a flag"});
      }
    }
    return s;
  }();
  try {
    Args args(words, spec);
    for (const std::string& name : kValued) {
      args.get(name);
      args.get_all(name);
      try {
        args.get_int(name, 0);
      } catch (const UsageError&) {
      }
      try {
        args.get_double(name, 0.0);
      } catch (const UsageError&) {
      }
      try {
        const long long bytes = args.get_bytes(name, 0);
        if (bytes < 0) {
          std::abort();  // sizes are never negative
        }
      } catch (const UsageError&) {
      }
    }
    for (const std::string& name : kFlags) {
      args.has(name);
    }
  } catch (const UsageError&) {
    // a bad command line, reported as one
  }
  for (const std::string& word : words) {
    try {
      if (paratrain::cli::parse_bytes(word, "size") < 0) {
        std::abort();
      }
    } catch (const UsageError&) {
    }
  }
  return 0;
}
