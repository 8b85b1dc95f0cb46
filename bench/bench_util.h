#pragma once

// Shared by the benchmark programs: medians, and reading back the flat JSON rows that their
// worker processes append to a results file (one object per line, string or number values).

#include "args.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

inline double median(std::vector<double> v) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The value of "key" in a flat JSON row written by a benchmark worker; "" when absent.
inline std::string json_field(const std::string& line, const std::string& key) {
  auto p = line.find("\"" + key + "\": ");
  if (p == std::string::npos) {
    return "";
  }
  p += key.size() + 4;
  auto e = line.find_first_of(",}", p);
  std::string v = line.substr(p, e - p);
  if (!v.empty() && v.front() == '"') {
    v = v.substr(1, v.size() - 2);
  }
  return v;
}

// The workloads of `bench ddp` and `bench strategies`: the model, its batch per rank (per
// replica for DataParallel), the input shape for that batch, warm-up and timed steps.
struct Workload {
  std::string name;
  std::string model;
  int batch;
  std::vector<int64_t> shape;
  int warmup;
  int steps;
};

inline Workload workload(const std::string& name, int steps_override) {
  if (name == "mlp") {
    return {"mlp", "mlp", 64, {64, 1, 28, 28}, 10, steps_override > 0 ? steps_override : 60};
  }
  if (name == "resnet18") {
    return {"resnet18", "resnet18_cifar",
            16,         {16, 3, 32, 32},
            2,          steps_override > 0 ? steps_override : 16};
  }
  throw UsageError("unknown workload '" + name + "': choose mlp or resnet18");
}

inline std::string row_json(const std::map<std::string, std::string>& fields) {
  std::ostringstream s;
  s << "{";
  bool first = true;
  for (const auto& kv : fields) {
    s << (first ? "" : ", ") << "\"" << kv.first << "\": " << kv.second;
    first = false;
  }
  s << "}";
  return s.str();
}

inline std::string quoted(const std::string& s) {
  return "\"" + s + "\"";
}

}  // namespace cli
}  // namespace paratrain
