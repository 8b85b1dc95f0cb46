#pragma once

// The command lines of the subcommands, read with CLI11 (Debian's libcli11-dev): each command
// declares its options once, in a CommandSpec, and both the parser and `--help` come from it.
// Every command also takes `--config FILE.toml`, whose keys are the long option names
// (`lr = 0.1`, `lr-schedule = "cosine"`, `json = true`); the command line overrides the file.
// Values are kept as the text the user wrote and converted by the getters, so a bad value gets
// a message naming the option.

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace CLI {
class App;
class Option;
struct ConfigItem;
}  // namespace CLI

namespace paratrain {
namespace cli {

/// Thrown for bad command lines; run_guarded() prints it with the usage hint and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The help of an internal option, hidden from `--help` and the reference (a worker's own
/// options). Any other option must have a help text: Args refuses an empty one, so that no flag
/// reaches users, or the generated reference (docs/reference.md), without it.
inline const char* const kInternalOption = "(internal)";

/// One option: `names` is the long name without dashes, then any aliases after commas
/// ("nproc-per-node,nproc_per_node"); `value` names its value in the help ("N", "DIR"), empty
/// for a flag; `help` says what it does, or is kInternalOption.
struct OptionSpec {
  std::string names;
  std::string value;
  std::string help;
  /// Every occurrence counts (get_all), and a config file may give a list. Otherwise the last
  /// occurrence wins, and a config list (`lr-milestones = [30, 60]`) is read as "30,60".
  bool repeatable = false;
};

/// A subcommand's command line. `program`: it takes "-- PROGRAM ARGS..." (paratrain launch).
struct CommandSpec {
  std::string name;         // "paratrain train"
  std::string description;  // printed above the options
  std::vector<OptionSpec> options;
  std::string footer = "";  // printed below the options
  bool program = false;
};

class Args {
 public:
  /// Parses `argv` (the words after the subcommand) against `spec`. Throws UsageError for an
  /// unknown option (naming the nearest known one), a missing value, an unreadable config file
  /// or an unknown key in it (naming the nearest valid key).
  Args(const std::vector<std::string>& argv, const CommandSpec& spec);

  /// Whether an option was given (on the command line or in the config); `help` for --help.
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
  /// The help made from the spec: text, or with PARATRAIN_HELP_FORMAT=markdown a Markdown
  /// section (the generated reference, scripts/reference.py).
  const std::string& help() const { return help_; }

 private:
  void parse(CLI::App& app,
             const std::vector<std::string>& words,
             const CommandSpec& spec,
             const std::vector<std::string>& known);
  void collect(const OptionSpec& o,
               const CLI::Option& opt,
               const std::vector<CLI::ConfigItem>& items);

  std::multimap<std::string, std::string> values_;
  std::vector<std::string> rest_;
  std::string help_;
};

long long parse_bytes(const std::string& text, const std::string& what);

/// The non-empty items of a comma-separated list ("a,,b" gives a and b).
std::vector<std::string> split_list(const std::string& text);

/// The entry of `choices` closest to `word` by edit distance (empty when `choices` is).
std::string nearest(const std::string& word, const std::vector<std::string>& choices);

}  // namespace cli
}  // namespace paratrain
