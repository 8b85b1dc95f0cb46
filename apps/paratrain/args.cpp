#include "args.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace paratrain {
namespace cli {

Args::Args(const std::vector<std::string>& argv,
           const std::set<std::string>& valued,
           const std::set<std::string>& flags) {
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--") {
      rest_.assign(argv.begin() + static_cast<long>(i) + 1, argv.end());
      return;
    }
    if (a.rfind("--", 0) != 0) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::string value;
    bool inline_value = false;
    auto eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if (flags.count(name)) {
      if (inline_value) {
        throw UsageError("--" + name + " takes no value");
      }
      values_.emplace(name, "1");
    } else if (valued.count(name)) {
      if (!inline_value) {
        if (i + 1 >= argv.size()) {
          throw UsageError("--" + name + " needs a value");
        }
        value = argv[++i];
      }
      values_.emplace(name, value);
    } else {
      throw UsageError("unknown option --" + name);
    }
  }
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto range = values_.equal_range(name);
  if (range.first == range.second) {
    return fallback;
  }
  return std::prev(range.second)->second;  // the last one wins, as in most CLIs
}

std::vector<std::string> Args::get_all(const std::string& name) const {
  std::vector<std::string> out;
  auto range = values_.equal_range(name);
  for (auto it = range.first; it != range.second; ++it) {
    out.push_back(it->second);
  }
  return out;
}

int Args::get_int(const std::string& name, int fallback) const {
  if (!has(name)) {
    return fallback;
  }
  std::string text = get(name);
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < -2147483647L || v > 2147483647L) {
    throw UsageError("--" + name + " '" + text + "' is not an integer");
  }
  return static_cast<int>(v);
}

double Args::get_double(const std::string& name, double fallback) const {
  if (!has(name)) {
    return fallback;
  }
  std::string text = get(name);
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v)) {
    throw UsageError("--" + name + " '" + text + "' is not a number");
  }
  return v;
}

long long parse_bytes(const std::string& text, const std::string& what) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    ++i;
  }
  std::string unit = text.substr(i);
  long long scale = 0;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else if (unit == "K" || unit == "KiB" || unit == "k") {
    scale = 1LL << 10;
  } else if (unit == "M" || unit == "MiB") {
    scale = 1LL << 20;
  } else if (unit == "G" || unit == "GiB") {
    scale = 1LL << 30;
  }
  if (i == 0 || i > 12 || scale == 0) {
    throw UsageError(what + " '" + text + "' is not a size; write it as 4096, 1K, 64M or 1G");
  }
  const long long count = std::stoll(text.substr(0, i));  // at most 12 digits: fits
  if (count > std::numeric_limits<long long>::max() / scale) {
    throw UsageError(what + " '" + text + "' is too large");
  }
  return count * scale;
}

long long Args::get_bytes(const std::string& name, long long fallback) const {
  return has(name) ? parse_bytes(get(name), "--" + name) : fallback;
}

}  // namespace cli
}  // namespace paratrain
