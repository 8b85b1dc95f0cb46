#pragma once

// Internal: the string tests the library's file and tensor names need (C++17 has no
// starts_with/ends_with), and the byte counts its messages print.

#include <cstdint>
#include <cstdio>
#include <string>

namespace paratrain {
namespace detail {

inline bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

inline bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// `bytes` in GiB with two decimals, as messages about memory and disk print it ("1.50 GiB").
inline std::string gib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return text;
}

}  // namespace detail
}  // namespace paratrain
