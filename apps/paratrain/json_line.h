#pragma once

// The JSON rows the CLI prints (--json) and its benchmark workers exchange: nlohmann-json encodes
// the keys and values; the layout is one line with Python's json.dumps separators, so a row reads
// the same as PyTorch-side scripts' rows and stays greppable.

#include <nlohmann/json.hpp>

#include <string>

namespace paratrain {
namespace cli {

using JsonRow = nlohmann::ordered_json;  // keys keep the order they were added in

/// `{"key": value, ...}` on one line; nested arrays and objects are written compactly.
inline std::string json_line(const JsonRow& row) {
  std::string out = "{";
  for (auto it = row.begin(); it != row.end(); ++it) {
    out += (it == row.begin() ? "" : ", ") + JsonRow(it.key()).dump() + ": " + it.value().dump();
  }
  return out + "}";
}

}  // namespace cli
}  // namespace paratrain
