#pragma once

// A small command-line reader for the subcommands: "--name value", "--name=value", flags, and
// everything after "--" kept verbatim. Unknown options are errors that name the option.

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

/// Thrown for bad command lines; main() prints it with the usage hint and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  /// `valued`: options that take a value; `flags`: options that do not.
  Args(const std::vector<std::string>& argv,
       const std::set<std::string>& valued,
       const std::set<std::string>& flags);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& fallback = "") const;
  int get_int(const std::string& name, int fallback) const;
  double get_double(const std::string& name, double fallback) const;
  /// "64M", "1KiB", "4096" -> bytes.
  long long get_bytes(const std::string& name, long long fallback) const;
  /// Repeated options, in order.
  std::vector<std::string> get_all(const std::string& name) const;
  /// Words after "--".
  const std::vector<std::string>& rest() const { return rest_; }
  /// Words before "--" that are not options.
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::multimap<std::string, std::string> values_;
  std::vector<std::string> rest_;
  std::vector<std::string> positional_;
};

long long parse_bytes(const std::string& text, const std::string& what);

}  // namespace cli
}  // namespace paratrain
