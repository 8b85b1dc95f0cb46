#pragma once

// The frame every benchmark of paratrain-bench runs in (header-only, as bench/bench_util.h): its
// options, declared once with the value each takes under --smoke, from which both the parser and
// `--help` come; the options every benchmark has (--json, --smoke, and the hidden --worker and
// --out of those that run themselves again as worker processes); a worker's command line; and the
// JSON rows, nlohmann objects from the worker that measures to the line printed, one per line.
//
// --smoke is the smallest run that still goes through every code path of a benchmark: tiny
// sizes, one repeat, a step or two, a few seconds. Its numbers mean nothing; it is for the tests
// (tests/bench/smoke_test.cpp) and for trying a change before a long measurement. Under --smoke
// the PyTorch (or Optuna) side runs only when --python names the Python: starting Python and
// importing torch costs more than the rest of a smoke run, so rows say it was skipped
// (kSkippedUnderSmoke) instead.
//
// A benchmark that needs what this machine lacks (root for network namespaces, SQLite) says so in
// one line, "paratrain bench NAME: not available here: WHY", and exits 0 with no rows
// (not_available), so that a suite of benchmarks can run where only some of them can.

#include "args.h"
#include "benchmarks.h"
#include "commands.h"
#include "json_line.h"

#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

/// Throws std::runtime_error with `message` unless `ok`. Not TORCH_CHECK, whose message would
/// carry this file's path into the installed program.
inline void require(bool ok, const std::string& message) {
  if (!ok) {
    throw std::runtime_error(message);
  }
}

/// One option of a benchmark: `names`, `value` and `help` as in OptionSpec (kInternalOption hides
/// a worker's own option), and `smoke`, the value a valued option takes under --smoke when the
/// command line does not give it ("": the same as without --smoke).
struct BenchOption {
  std::string names;
  std::string value;
  std::string help;
  std::string smoke = "";
};

/// A benchmark's command line, declared once.
struct BenchSpec {
  std::string name;         // as in `paratrain bench NAME`
  std::string description;  // printed above the options
  std::vector<BenchOption> options;
  std::string json_help = "print JSON rows, one object per line";
  /// Runs itself again as worker processes (`paratrain-bench NAME --worker --out FILE ...`):
  /// adds the hidden --worker and --out.
  bool workers = false;
};

/// What a row says in place of the PyTorch side that --smoke skipped.
inline const char* const kSkippedUnderSmoke = "skipped under --smoke (give --python to run it)";

/// The parsed command line of one benchmark run, worker or parent.
class Bench {
 public:
  Bench(const BenchSpec& spec, const std::vector<std::string>& argv)
      : spec_(spec), args_(argv, command_spec(spec)) {}

  const Args& args() const { return args_; }
  const std::string& name() const { return spec_.name; }
  bool json() const { return args_.has("json"); }
  bool smoke() const { return args_.has("smoke"); }
  /// Whether the command line (or --config) gave the option.
  bool has(const std::string& option) const { return args_.has(option); }

  /// The option's value: as given, else its smoke value under --smoke, else `fallback`.
  std::string get(const std::string& option, const std::string& fallback = "") const {
    const std::string* preset = smoke_value(option);
    return args_.get(option, preset ? *preset : fallback);
  }
  int get_int(const std::string& option, int fallback) const {
    const std::string* preset = smoke_value(option);
    return args_.get_int(option, preset ? std::stoi(*preset) : fallback);
  }
  double get_double(const std::string& option, double fallback) const {
    const std::string* preset = smoke_value(option);
    return args_.get_double(option, preset ? std::stod(*preset) : fallback);
  }
  long long get_bytes(const std::string& option, long long fallback) const {
    const std::string* preset = smoke_value(option);
    return args_.get_bytes(option, preset ? parse_bytes(*preset, "--" + option) : fallback);
  }

  /// Where a benchmark says what it does: stdout, or stderr under --json, whose stdout holds
  /// only rows.
  std::ostream& info() const { return json() ? std::cerr : std::cout; }
  /// One line of progress on stderr; none under --json.
  void progress(const std::string& line) const {
    if (!json()) {
      std::cerr << line << std::endl;
    }
  }

  /// A worker of this benchmark: {paratrain-bench, NAME, --worker, --out OUT, [--smoke], extra}.
  /// --smoke travels along, so that the worker takes the same smoke values.
  std::vector<std::string> worker_command(const std::string& out,
                                          const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> command{self_path(), spec_.name, "--worker", "--out", out};
    if (smoke()) {
      command.push_back("--smoke");
    }
    command.insert(command.end(), extra.begin(), extra.end());
    return command;
  }
  /// The options among `names` that the command line gave, as words for a worker's command line
  /// (`--steps 5`, `--gradient-as-bucket-view`).
  std::vector<std::string> forwarded(const std::vector<std::string>& names) const {
    std::vector<std::string> words;
    for (const auto& name : names) {
      const BenchOption* o = find(name);
      require(o != nullptr,
              "bench " + spec_.name + " forwards --" + name + ", not an option of it");
      if (has(name)) {
        words.push_back("--" + name);
        if (!o->value.empty()) {
          words.push_back(args_.get(name));
        }
      }
    }
    return words;
  }

 private:
  static CommandSpec command_spec(const BenchSpec& spec) {
    CommandSpec out{"paratrain bench " + spec.name, spec.description, {}};
    for (const auto& o : spec.options) {
      std::string help = o.help;
      if (help != kInternalOption && !o.smoke.empty()) {
        help += " [--smoke: " + o.smoke + "]";
      }
      out.options.push_back({o.names, o.value, help});
    }
    out.options.push_back({"json", "", spec.json_help});
    out.options.push_back(
        {"smoke", "", "the smallest run through every code path, in seconds (for tests)"});
    if (spec.workers) {
      out.options.push_back({"worker", "", kInternalOption});
      out.options.push_back({"out", "FILE", kInternalOption});
    }
    return out;
  }
  const BenchOption* find(const std::string& name) const {
    for (const auto& o : spec_.options) {
      if (o.names == name || o.names.rfind(name + ",", 0) == 0) {
        return &o;
      }
    }
    return nullptr;
  }
  const std::string* smoke_value(const std::string& name) const {
    const BenchOption* o = smoke() ? find(name) : nullptr;
    return o != nullptr && !o->smoke.empty() ? &o->smoke : nullptr;
  }

  const BenchSpec& spec_;  // the benchmarks' specs are static
  Args args_;
};

/// The body of a benchmark, or of its workers.
using BenchBody = int (*)(const Bench& bench);

/// Parses `argv` against `spec` and runs the benchmark: --help prints its options, --worker runs
/// `worker`, anything else `run`. Returns the exit code.
inline int run_benchmark(const BenchSpec& spec,
                         const std::vector<std::string>& argv,
                         BenchBody run,
                         BenchBody worker = nullptr) {
  const Bench bench(spec, argv);
  if (bench.has("help")) {
    std::cout << bench.args().help();
    return 0;
  }
  if (bench.has("worker")) {
    require(worker != nullptr, "bench " + spec.name + " declares workers but has none");
    return worker(bench);
  }
  return run(bench);
}

/// Says in one line that this benchmark cannot run on this machine, and why; returns 0, the exit
/// code of a run with nothing to measure.
inline int not_available(const Bench& bench, const std::string& why) {
  std::cerr << "paratrain bench " << bench.name() << ": not available here: " << why << std::endl;
  return 0;
}

/// One row as text: a worker's line of a results file, or a PyTorch script's. Throws for a line
/// that is not a JSON object (a row mixed with other output).
inline JsonRow parse_row(const std::string& line) {
  JsonRow row = JsonRow::parse(line, nullptr, /*allow_exceptions=*/false);
  require(row.is_object(), "a benchmark worker wrote a row that is not a JSON object: " + line);
  return row;
}

/// Appends `row` to a results file, one line (the workers' rows for the parent).
inline void append_row(const std::string& path, const JsonRow& row) {
  std::ofstream out(path, std::ios::app);
  out << json_line(row) << std::endl;
  require(out.good(), "cannot append a benchmark row to " + path);
}

/// The rows of a results file, in the order written.
inline std::vector<JsonRow> read_rows(const std::string& path) {
  std::vector<JsonRow> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    rows.push_back(parse_row(line));
  }
  return rows;
}

/// Prints `row` as one line of stdout (the --json output).
inline void print_row(const JsonRow& row) {
  std::cout << json_line(row) << "\n";
}

/// The number `key` of `row`; NaN for null, which is how JSON writes a non-finite number. Throws
/// naming the key when the row lacks it.
inline double number_field(const JsonRow& row, const std::string& key) {
  const auto it = row.find(key);
  require(it != row.end() && (it->is_number() || it->is_null()),
          "a benchmark row has no number '" + key + "': " + json_line(row));
  return it->is_null() ? std::numeric_limits<double>::quiet_NaN() : it->get<double>();
}

/// The string `key` of `row` ("" when absent).
inline std::string string_field(const JsonRow& row, const std::string& key) {
  const auto it = row.find(key);
  return it != row.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace cli
}  // namespace paratrain
