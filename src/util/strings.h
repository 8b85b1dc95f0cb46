#pragma once

// Internal: the string tests the library's file and tensor names need (C++17 has no
// starts_with/ends_with).

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

}  // namespace detail
}  // namespace paratrain
