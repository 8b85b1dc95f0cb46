#pragma once

// What the test workers share: their flags ("--name value", or "--name" alone, which reads "1"),
// and the error a worker throws when its run differs from the reference it is compared with.

#include <map>
#include <stdexcept>
#include <string>

namespace paratrain_test_programs {

using Options = std::map<std::string, std::string>;

inline Options parse_options(int argc, char** argv) {
  Options out;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    out[name] = (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) ? argv[++i] : "1";
  }
  return out;
}

/// The value of flag `name`, or `fallback` when it was not given.
inline std::string get(const Options& o, const std::string& name, const std::string& fallback) {
  auto it = o.find(name);
  return it == o.end() ? fallback : it->second;
}

struct Mismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace paratrain_test_programs
