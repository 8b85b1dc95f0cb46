#pragma once

// The anchors of the benchmarks: the Pythons whose PyTorch, Optuna and Ray Tune the benchmarks
// compare paratrain with, every one found in one run, side by side; and the target checks that
// the reports print against the strongest of them.
//
// By default a benchmark runs two Pythons when they are present: Debian's /usr/bin/python3
// (python3-torch 1.13.1, python3-optuna 3.1) and the virtual environment of PyPI packages
// (PARATRAIN_VENV, default /var/cache/paratrain/py; `bash scripts/venv.sh --bench` makes it with
// PyTorch 2.15, Ray Tune and current Optuna). --python LIST (or PARATRAIN_PYTHON) names others.
// bench/anchor_probe.py says what each one has, so that rows carry the version that ran
// (`pytorch-1.13.1`, `anchor_version`), and a benchmark leaves out an anchor that lacks what it
// needs, in one line.

#include "bench_util.h"
#include "harness.h"
#include "json_line.h"

#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

/// Whether `system` names a PyTorch anchor's rows ("pytorch-2.15.0"; AnchorPython::label).
inline bool is_anchor_system(const std::string& system) {
  return system.rfind("pytorch-", 0) == 0;
}

/// The help of a benchmark's --python option: "the Pythons WHAT, comma-separated (default: ...)".
inline std::string anchor_pythons_help(const std::string& what) {
  return "the Pythons " + what +
         ", comma-separated (default: /usr/bin/python3 and $PARATRAIN_VENV/bin/python, those "
         "present; or PARATRAIN_PYTHON)";
}

/// One Python of the anchors, as bench/anchor_probe.py found it.
struct AnchorPython {
  std::string python;  // the interpreter, as given
  std::string torch;   // the release of its torch: "1.13.1" (Debian's), "2.15.0"
  bool mpi = false;    // torch.distributed.is_mpi_available()
  bool gloo = false;
  std::map<std::string, std::string> packages;  // lower-case name -> version, for those installed

  /// The name of its PyTorch rows: "pytorch-2.15.0".
  std::string label() const { return "pytorch-" + torch; }
  /// The version of `name` (lower case: "optuna", "ray", "torchvision"), "" when not installed.
  std::string package(const std::string& name) const {
    const auto it = packages.find(name);
    return it == packages.end() ? "" : it->second;
  }
  /// Whether its torch.distributed has `backend` ("gloo", "mpi").
  bool has_backend(const std::string& backend) const {
    return backend == "mpi" ? mpi : backend == "gloo" ? gloo : false;
  }
};

/// The virtual environment of PyPI's packages: PARATRAIN_VENV, else /var/cache/paratrain/py.
inline std::string anchor_venv() {
  const char* env = std::getenv("PARATRAIN_VENV");
  return env != nullptr && env[0] != '\0' ? env : "/var/cache/paratrain/py";
}

/// What `python` has, or why it cannot be an anchor (`why`, then false).
inline bool probe_anchor(const std::string& python, AnchorPython& out, std::string& why) {
  const std::string command =
      "'" + python + "' '" + bench_script("anchor_probe.py") + "' 2>/dev/null";
  FILE* p = ::popen(command.c_str(), "r");
  std::string text;
  char buf[4096];
  while (p != nullptr && std::fgets(buf, sizeof(buf), p) != nullptr) {
    text += buf;
  }
  if (p == nullptr || ::pclose(p) != 0 || text.empty()) {
    why = python + " cannot run or cannot import torch";
    return false;
  }
  const JsonRow row = parse_row(text);
  out.python = python;
  out.torch = string_field(row, "torch");
  out.mpi = row.value("mpi", false);
  out.gloo = row.value("gloo", false);
  for (const auto& [name, version] : row.at("packages").items()) {
    if (version.is_string()) {
      out.packages[name] = version.get<std::string>();
    }
  }
  return true;
}

/// The Pythons of a benchmark's anchors, in the order given, one per torch version: --python
/// LIST (comma-separated), else PARATRAIN_PYTHON (the same), else /usr/bin/python3 and the
/// venv's bin/python. None with --no-pytorch, nor under --smoke unless --python names them. A
/// Python named on purpose that cannot import torch is an error; a default one is left out in
/// one line. Throws when no default one imports torch.
inline std::vector<AnchorPython> anchor_pythons(const Bench& bench) {
  if (bench.has("no-pytorch") || (bench.smoke() && !bench.has("python"))) {
    return {};
  }
  const char* env = std::getenv("PARATRAIN_PYTHON");
  std::string named = bench.get("python", env != nullptr ? env : "");
  const bool chosen = !named.empty();
  if (!chosen) {
    named = "/usr/bin/python3," + anchor_venv() + "/bin/python";
  }
  std::vector<AnchorPython> out;
  for (const auto& python : split_list(named)) {
    AnchorPython a;
    std::string why;
    if (!probe_anchor(python, a, why)) {
      require(!chosen, "the anchor Python " + why + ": give --python a Python with torch");
      std::cerr << "paratrain bench " << bench.name() << ": leaving out " << why
                << (python.rfind(anchor_venv(), 0) == 0
                        ? " (bash scripts/venv.sh --bench makes PyPI's PyTorch there)"
                        : "")
                << std::endl;
      continue;
    }
    bool seen = false;
    for (const auto& other : out) {
      seen = seen || other.torch == a.torch;
    }
    if (!seen) {
      out.push_back(a);
    }
  }
  require(!out.empty() || chosen,
          "no Python with torch found (tried /usr/bin/python3 and " + anchor_venv() +
              "/bin/python): pass --python /path/to/python3, or skip PyTorch with --no-pytorch");
  return out;
}

/// The anchors of `anchors` that have Python package `package`; says in one line which are left
/// out for lacking it.
inline std::vector<AnchorPython> anchors_with(const Bench& bench,
                                              const std::vector<AnchorPython>& anchors,
                                              const std::string& package) {
  std::vector<AnchorPython> out;
  for (const auto& a : anchors) {
    if (a.package(package).empty()) {
      std::cerr << "paratrain bench " << bench.name() << ": " << a.python << " (PyTorch " << a.torch
                << ") has no " << package << ": no " << package << " rows from it" << std::endl;
    } else {
      out.push_back(a);
    }
  }
  return out;
}

/// Fields every row of an anchor carries: its version and its Python.
inline void mark_anchor(JsonRow& row, const AnchorPython& a, const std::string& version) {
  row["anchor_version"] = version;
  row["anchor_python"] = a.python;
}

/// One condition of a target: `field` (a ratio, a difference) against `bound`, at most or at
/// least.
struct TargetCheck {
  std::string field;
  double value;
  double bound;
  bool at_most;
  bool met() const { return at_most ? value <= bound : value >= bound; }
};

/// A target of the benchmarks, checked against the strongest anchor of the same run: `name`
/// ("ddp-step mlp gloo"), `against` (the anchor's row name), its conditions, all of which must
/// hold, and figures that tell on what terms it was checked (PBT's epochs ratio).
struct Target {
  std::string name;
  std::string against;
  std::vector<TargetCheck> checks;
  std::vector<std::pair<std::string, double>> notes = {};
  bool met() const {
    for (const auto& c : checks) {
      if (!c.met()) {
        return false;
      }
    }
    return true;
  }
};

/// A target as a row: {"target", "against", each field and "FIELD_bound": "<= 1.00", "met"}.
inline JsonRow target_row(const Target& t) {
  JsonRow row{{"target", t.name}, {"against", t.against}};
  for (const auto& c : t.checks) {
    std::ostringstream bound;
    bound << (c.at_most ? "<= " : ">= ") << c.bound;
    row[c.field] = c.value;
    row[c.field + "_bound"] = bound.str();
  }
  for (const auto& [field, value] : t.notes) {
    row[field] = value;
  }
  row["met"] = t.met();
  return row;
}

/// A target as a line of a report: "target ddp-step mlp gloo against pytorch-2.15.0:
/// ratio 0.93 (at most 1.00): met".
inline std::string target_line(const Target& t) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(4) << "target " << t.name << " against " << t.against << ":";
  for (size_t i = 0; i < t.checks.size(); ++i) {
    const TargetCheck& c = t.checks[i];
    s << (i ? "," : "") << " " << c.field << " " << c.value << " ("
      << (c.at_most ? "at most " : "at least ") << c.bound << ")";
  }
  for (const auto& [field, value] : t.notes) {
    s << ", " << field << " " << value;
  }
  s << ": " << (t.met() ? "met" : "not met");
  return s.str();
}

/// Prints `t`: its row under --json, else its line.
inline void print_target(const Bench& bench, const Target& t) {
  if (bench.json()) {
    print_row(target_row(t));
  } else {
    std::cout << target_line(t) << "\n";
  }
}

}  // namespace cli
}  // namespace paratrain
