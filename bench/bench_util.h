#pragma once

// Shared by the benchmark programs: medians, and reading back the flat JSON rows that their
// worker processes append to a results file (one object per line, string or number values).

#include <algorithm>
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

}  // namespace cli
}  // namespace paratrain
